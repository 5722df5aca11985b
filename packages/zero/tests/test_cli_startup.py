"""Starting the ``zero`` CLI (every ``zero run`` / ``zero train`` launcher and each of its rank processes) does not
import torch's compiler stack: Dynamo costs seconds of start-up and is needed only by a model that is compiled, or
by a stage-3 store once it is attached to a model."""

import subprocess
import sys


def test_importing_the_cli_leaves_dynamo_unimported():
    code = (
        "import sys\nfrom zero.cli import main\nimport zero, zero_core\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout
