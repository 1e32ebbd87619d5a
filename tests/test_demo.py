"""The main job: mstar-lora demo on the built-in defaults runs end to end and checks itself."""

from __future__ import annotations

import pytest

from mstar.engine.resources.lora.tools.cli import main


def test_demo_runs_and_every_row_matches_merged_weights(tmp_path, capsys):
    assert main(["demo", "--keep", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "every row matches its adapter merged into the base weights" in out
    assert "too-big" in out and "refused: module model.layers.0.mlp.down_proj: rank 32, over this pool's max_rank 16" \
        in out
    assert "re-activating the resident ones copied 0 times" in out
    assert (tmp_path / "sql-expert" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("count", [0, 1])
def test_demo_with_few_adapters_still_serves_a_mixed_batch(tmp_path, capsys, count):
    assert main(["demo", "--adapters", str(count), "--keep", str(tmp_path)]) == 0
    assert "every row matches" in capsys.readouterr().out


def test_demo_refuses_more_adapters_than_it_has_samples(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--adapters", "7"])
    assert "'7' is not a number from 0 to 6" in capsys.readouterr().err
