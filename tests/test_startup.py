"""A controller (run, generate, serve) starts without torch: every local run starts ranks that
import it anyway, and a second of start-up per command adds up (the suite runs hundreds)."""

import subprocess
import sys

CHECK = """
import sys
import smoltrain.commands.generate, smoltrain.commands.run, smoltrain.commands.serve
import smoltrain.infer.launch, smoltrain.infer.mesh_layout, smoltrain.models.split, smoltrain.run.launch
from smoltrain import host
host.check_dtype("fp32", host.resolve_device("cpu"))
print(sorted(m for m in ("torch", "transformers", "matplotlib") if m in sys.modules))
"""


def test_controllers_import_no_torch():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_a_checkpoint_index_reads_headers_without_torch(tmp_path):
    from infer_models import make_checkpoint

    path = make_checkpoint(str(tmp_path / "m"), "llama", layers=2)
    code = (
        "import sys; from smoltrain.models.hf import Checkpoint; c = Checkpoint(sys.argv[1]); c.check(); "
        "print(len(c.index), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    n, torch_loaded = out.stdout.split()
    assert int(n) > 0 and torch_loaded == "False"
