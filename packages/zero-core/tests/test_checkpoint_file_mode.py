"""Checkpoint weight files get the process's default file mode, as the JSON beside them (safetensors alone
creates its files 0600, so other users of a shared machine could read a manifest but not its weights)."""

import torch

from zero_core.checkpoint import storage


def test_safetensors_and_json_share_the_umask_mode(tmp_path):
    storage.write_tensors(tmp_path / "w.safetensors", {"w": torch.arange(4.0)})
    storage.write_json(tmp_path / "m.json", {"a": 1})
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes["w.safetensors"] == 0o666 & ~storage._UMASK, modes
    assert modes["w.safetensors"] == modes["m.json"], modes
