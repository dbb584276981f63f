"""`specdec install-llama-cpp`: build specdec's patched llama-cpp-python and install it into the Python specdec runs on.

The work is the shipped installer, `specdec_cli/llama_build/install.py` (through `specdec_cli.models.build`); this
module says what it will do, for which backend and what that costs (one line each, from the installer's plan), runs
it with CMake's steps streaming to stderr, and checks that the Python now loads the patched build.
"""

from __future__ import annotations

import subprocess
import sys

from rich.text import Text

from specdec_cli.errors import BuildError
from specdec_cli.models import build

PATCH_NAMES = {
    "llama-cpp-python-flash-attn-switch.patch": "the flash-attention switch",
    "llama-cpp-python-amx-tileconfig.patch": "the AMX tile fix (llama.cpp issue 20824)",
}
# In a child Python: exit 0 when the installed llama-cpp-python is the patched build (it has llama_set_flash_attn).
_CHECK = "import llama_cpp, sys; sys.exit(0 if hasattr(llama_cpp.llama_cpp._lib, 'llama_set_flash_attn') else 1)"


def backend_line(plan: build.InstallPlan) -> str:
    """One line: the backend the build is for, and why."""
    return f"Backend: {plan.backend} ({plan.backend_reason})."


def describe(plan: build.InstallPlan) -> str:
    """One line: what the installer will do for this Python and what it costs."""
    patches = " and ".join(PATCH_NAMES.get(p, p) for p in plan.patches)
    where = f"{plan.prefix} ({plan.python})"
    if plan.state == "installed":
        return (
            f"llama-cpp-python {plan.version} in {where} is already specdec's patched build for this machine, "
            f"from {plan.wheel_dir}: nothing to do."
        )
    if plan.state == "cached":
        return (
            f"Installing llama-cpp-python {plan.version} ({plan.backend}) with {patches} into {where} from the "
            f"wheel built earlier for this machine ({plan.wheel_dir}): a few seconds."
        )
    return (
        f"Building llama-cpp-python {plan.version} ({plan.backend}) from its sdist with {patches} and installing "
        f"it into {where}: {build.BUILD_COST}; the wheel ({build.WHEEL_SIZE}) is kept in {plan.wheel_dir} for "
        "later installs."
    )


def execute(*, amx: str, dry_run: bool, backend: str = "auto") -> int:
    """Print the backend and the plan (stdout with `dry_run`, else stderr), then build and install. Returns 0; raises
    BuildError (exit 8) when a compiler is missing, a step fails, or the Python still loads another build afterwards."""
    from specdec_cli.cli.console import err_console, make_console

    plan = build.install_plan(sys.executable, amx=amx, backend=backend)
    if dry_run:
        out = make_console()
        out.print(Text(backend_line(plan)))
        out.print(Text(describe(plan)))
        if plan.cmake_args:
            out.print(Text(f"CMAKE_ARGS: {plan.cmake_args}"))
        return 0
    err = err_console()
    err.print(Text(backend_line(plan)))
    err.print(Text(describe(plan), style="bold"))
    if plan.state == "installed":
        return 0
    build.install(plan)
    check = subprocess.run([sys.executable, "-c", _CHECK], stdin=subprocess.DEVNULL, capture_output=True)
    if check.returncode != 0:
        raise BuildError(
            f"The install finished, but {sys.executable} does not load the patched build (no llama_set_flash_attn).",
            "Run specdec doctor to see which llama.cpp it loads.",
        )
    err.print(
        Text(
            f"Done: {sys.executable} now loads specdec's patched llama.cpp build (specdec doctor shows it).",
            style="bold",
        )
    )
    return 0
