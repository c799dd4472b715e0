"""``python -m paramshard ...``: the same as the ``paramshard`` command."""

from paramshard.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
