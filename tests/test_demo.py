"""The main job: mstar-lora demo on the built-in defaults runs end to end and checks itself."""

from __future__ import annotations

from mstar.engine.resources.lora.tools.cli import main


def test_demo_runs_and_every_row_matches_merged_weights(tmp_path, capsys):
    assert main(["demo", "--keep", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "every row matches its adapter merged into the base weights" in out
    assert "too-big" in out and "refused: module model.layers.0.mlp.down_proj: rank 32, over this pool's max_rank 16" \
        in out
    assert "re-activating the resident ones copied 0 times" in out
    assert (tmp_path / "sql-expert" / "adapter_model.safetensors").is_file()
