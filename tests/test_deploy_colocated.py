"""docker/k8s/colocated/: trainer and server in one pod (shared memory, docs/transport.md).

Checked like the other deployment files (test_deploy_files.py): kubernetes-validate --strict
against the newest schemas it ships and 1.29, the first Kubernetes whose sidecar containers
(an init container with ``restartPolicy: Always``) are on by default; then the facts a schema
cannot know: each pod's server and rank share the completion index, the rank's server list
names every pod of the Job through the headless Service, and the server is a sidecar, so the
Job completes when the trainer does.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_deploy_files import K8S, PORT, TOKEN_FILE, manifests, parse_paramshard, run, tool, yaml

from paramshard import cli

COLOCATED = K8S / "colocated" / "train.yaml"
INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
pytestmark = pytest.mark.timeout(120)


def objects() -> dict[str, dict[str, Any]]:
    docs = [o for o in yaml.safe_load_all(COLOCATED.read_text()) if o]
    by_kind = {o["kind"]: o for o in docs}
    assert len(by_kind) == len(docs), "one object of each kind"
    return by_kind


@pytest.mark.parametrize("version", [None, "1.29.0"])
def test_colocated_manifest_is_valid_strictly(version: str | None) -> None:
    validate = tool("kubernetes-validate", "kubernetes-validate")
    result = run(validate, "--strict", *(["-k", version] if version else []), str(COLOCATED))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(" passed for resource ") == len(objects()), result.stdout


def test_each_pod_runs_server_and_rank_of_one_index() -> None:
    m = objects()
    job, service, policy = m["Job"], m["Service"], m["NetworkPolicy"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    # pods are JOB-i.SERVICE: the Service is headless and selects the Job's pods
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert policy["spec"]["podSelector"]["matchLabels"] == service["spec"]["selector"]

    (server,) = pod["initContainers"]
    assert server["restartPolicy"] == "Always"  # a sidecar: the Job ends with the trainer
    env = {e["name"]: e for e in server["env"]}
    assert env["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == INDEX
    serve = server["args"]
    assert serve[serve.index("--index") + 1] == "$(POD_INDEX)"
    assert serve[serve.index("--token-file") + 1] == TOKEN_FILE
    assert "grpc" in server["startupProbe"]  # the trainer starts once the server answers
    assert server["resources"]["limits"]["nvidia.com/gpu"] == 1
    claim = {v["name"]: v for v in pod["volumes"]}["snapshots"]["persistentVolumeClaim"]
    pvc = manifests()["PersistentVolumeClaim"]
    assert claim["claimName"] == pvc["metadata"]["name"]
    parser = cli.build_parser()
    parser.parse_args(["serve", *(a.replace("$(POD_INDEX)", "0") for a in serve)])

    (trainer,) = pod["containers"]
    tenv = {e["name"]: e for e in trainer["env"]}
    assert tenv["RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == INDEX
    assert tenv["PARAMSHARD_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "paramshard-token"
    args = parse_paramshard(trainer["args"], RANK="1")
    assert args.command == "launch"
    assert (args.nnodes, args.node_rank, args.nproc) == (spec["completions"], 1, 1)
    name, sub = job["metadata"]["name"], service["metadata"]["name"]
    # rank i's own server (pod i, where memory is shared) is server i
    expected = [f"{name}-{i}.{sub}:{PORT}" for i in range(spec["completions"])]
    assert args.servers == ",".join(expected)
