"""scripts/bench_adapter_sync.py on k3-tiny: the per-rank bytes of the shard-to-shard sync against gathering the
whole adapter, from the same plan the loop runs (meta builds in a fake world, so a subprocess)."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_adapter_sync.py"


def test_blocks_that_coincide_move_nothing_and_sharded_engines_receive_less_than_a_gather(tmp_path):
    out = tmp_path / "sync.json"
    cmd = [sys.executable, str(SCRIPT), "--preset", "k3-tiny", "--gpus", "4", "--layout", "tp=2,pp=2"]
    cmd += ["--engine-layout", "tp=2,ep=0", "--engine-layout", "tp=4,ep=1", "--engine-layout", "tp=1"]
    done = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    same_tp, ep4, whole = json.loads(out.read_text())
    # trainer TP=2 against engine TP=2: each rank's own TP blocks, but the other pipeline stage's layers move
    assert 0 < same_tp["received_gib_max"] < same_tp["gather_received_gib_max"]
    assert ep4["received_gib_max"] <= ep4["engine_block_gib_max"] < whole["engine_block_gib_max"]
    # engine replicas of one rank need the whole adapter: a rank receives all but its own blocks, as a gather
    assert whole["engine_block_gib_max"] == whole["adapter_gib"]
    assert whole["received_gib_max"] == whole["gather_received_gib_max"]
    assert "GiB per rank per step" in done.stdout
