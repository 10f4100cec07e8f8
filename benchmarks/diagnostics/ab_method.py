"""Run a module as __main__ with one method (or function) taken from an older copy of its
source file, so one device call times a change before and after:

    git show REV:rollout/model/runner.py > .cache/runner_before.py
    python -m benchmarks.diagnostics.ab_method rollout.model.runner:ModelRunner._finish .cache/runner_before.py \\
        benchmarks.spec --gpu ...

The old copy is imported under its own name; the named attribute is swapped into the live
module before MODULE runs (what it calls in its own module is the old file's)."""

from __future__ import annotations

import importlib
import importlib.util
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    target, old_file, module, *args = sys.argv[1:]
    mod_name, _, attr_path = target.partition(":")
    spec = importlib.util.spec_from_file_location("ab_method_before", old_file)
    before = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = before  # (dataclasses in it look their module up)
    spec.loader.exec_module(before)
    live = importlib.import_module(mod_name)
    *owners, name = attr_path.split(".")
    new_owner, old_owner = live, before
    for part in owners:
        new_owner, old_owner = getattr(new_owner, part), getattr(old_owner, part)
    setattr(new_owner, name, getattr(old_owner, name))
    print(f"{target}: taken from {old_file}", flush=True)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__")


if __name__ == "__main__":
    main()
