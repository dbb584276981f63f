"""`specdec install-llama-cpp`: build specdec's patched llama-cpp-python and install it into the Python specdec runs on.

The work is the shipped install-llama-cpp.sh (`specdec_cli.models.build`); this module says what it will do and what
that costs (one line, from the script's --dry-run), runs it with CMake's steps streaming to stderr, and checks that
the Python now loads the patched build.
"""

from __future__ import annotations

import subprocess
import sys

from rich.text import Text

from specdec_cli.errors import BuildError
from specdec_cli.models import build

PATCH_NAMES = {"llama-cpp-python-flash-attn-switch.patch": "the flash-attention switch",
               "llama-cpp-python-amx-tileconfig.patch": "the AMX tile fix (llama.cpp issue 20824)"}
# In a child Python: exit 0 when the installed llama-cpp-python is the patched build (it has llama_set_flash_attn).
_CHECK = "import llama_cpp, sys; sys.exit(0 if hasattr(llama_cpp.llama_cpp._lib, 'llama_set_flash_attn') else 1)"


def describe(plan: build.InstallPlan) -> str:
    """One line: what the script will do for this Python and what it costs."""
    patches = " and ".join(PATCH_NAMES.get(p, p) for p in plan.patches)
    where = f"{plan.prefix} ({plan.python})"
    if plan.state == "installed":
        return (f"llama-cpp-python {plan.version} in {where} is already specdec's patched build for this machine, "
                f"from {plan.wheel_dir}: nothing to do.")
    if plan.state == "cached":
        return (f"Installing llama-cpp-python {plan.version} with {patches} into {where} from the wheel built "
                f"earlier for this machine ({plan.wheel_dir}): a few seconds.")
    return (f"Building llama-cpp-python {plan.version} from its sdist with {patches} and installing it into {where}: "
            f"{build.BUILD_COST}; the wheel ({build.WHEEL_SIZE}) is kept in {plan.wheel_dir} for later installs.")


def execute(*, amx: str, dry_run: bool) -> int:
    """Print the plan (stdout with `dry_run`, else stderr), then build and install. Returns 0; raises BuildError
    (exit 8) when a tool is missing, the build fails, or the Python still loads another build afterwards."""
    from specdec_cli.cli.console import err_console, make_console

    plan = build.install_plan(sys.executable, amx=amx)
    if dry_run:
        out = make_console()
        out.print(Text(describe(plan)))
        if plan.cmake_args:
            out.print(Text(f"CMAKE_ARGS: {plan.cmake_args}"))
        return 0
    err = err_console()
    err.print(Text(describe(plan), style="bold"))
    if plan.state == "installed":
        return 0
    build.install(sys.executable, amx=amx)
    check = subprocess.run([sys.executable, "-c", _CHECK], stdin=subprocess.DEVNULL, capture_output=True)
    if check.returncode != 0:
        raise BuildError(f"The install finished, but {sys.executable} does not load the patched build "
                         "(no llama_set_flash_attn).", "Run specdec doctor to see which llama.cpp it loads.")
    err.print(Text(f"Done: {sys.executable} now loads specdec's patched llama.cpp build (specdec doctor shows it).",
                   style="bold"))
    return 0
