"""Every way the docs import commd works in a fresh interpreter, whatever is imported first.

The rest of the suite imports torch before commd (conftest does), so it never meets an
import order in which torch's backend autoloading runs while a commd module is half
imported.  Each case here is a new interpreter, with torch's autoloading on and off;
after the imports the "commd" backend must be registered, with no warning.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

IMPORT_FORMS = [
    "import commd; from commd.client import Client",
    "from commd.client import Client, ops",
    "import commd.client.fastring",
    "from commd.client.errors import CommTimeoutError; import torch",
    "import torch.distributed as dist; import commd",
    "from commd import Options",
    "import commd.torch_backend.process_group",
]

CHECK = """
import warnings
warnings.simplefilter("error")
{imports}
import torch.distributed as dist
assert "commd" in dist.Backend.backend_list, dist.Backend.backend_list
print("registered")
"""


#: torch's autoloading off: commd's own import hook registers, after torch finishes loading.
WITHOUT_AUTOLOAD = ["from commd.client import Client, ops", "import torch; import commd"]

CASES = [(form, "1") for form in IMPORT_FORMS] + [(form, "0") for form in WITHOUT_AUTOLOAD]


@pytest.mark.parametrize(("imports", "autoload"), CASES)
def test_import_form_registers_the_backend(imports: str, autoload: str) -> None:
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": autoload}
    proc = subprocess.run([sys.executable, "-c", CHECK.format(imports=imports)], env=env, capture_output=True,
                          text=True, timeout=120, cwd="/")
    assert proc.returncode == 0 and "registered" in proc.stdout, (
        f"{imports!r} with TORCH_DEVICE_BACKEND_AUTOLOAD={autoload}:\n{proc.stderr[-3000:]}")
