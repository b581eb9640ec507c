"""A process SIGKILLed in the middle of a save leaves the previous step restorable and
the partial one invisible, and the next save cleans the leftovers up."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# The child saves step 1 and waits for it, then starts step 2 and is killed at `stage`:
#   "orbax-writing": right after save() returned (shards still being written),
#   "before-rename": manifest written inside step_2.tmp, rename not yet done.
CHILD = textwrap.dedent(
    """
    import sys, time
    import jax
    jax.config.update("jax_num_cpu_devices", 2)
    import numpy as np
    from jaxlearn.checkpoint import Checkpointer, commit

    directory, stage = sys.argv[1], sys.argv[2]

    def hang(*args, **kwargs):
        print("HANGING", flush=True)
        time.sleep(600)

    ckpt = Checkpointer.default_config().set(directory=directory, keep_last_n=1).instantiate()
    ckpt.save(1, {"w": jax.numpy.full((256, 256), 1.0)}, data_iterator_state=b"one")
    ckpt.wait_until_finished()
    if stage == "before-rename":
        commit.publish = hang
    big = np.random.default_rng(0).standard_normal((4096, 4096), dtype=np.float32)
    ckpt.save(2, {"w": jax.numpy.asarray(big)}, data_iterator_state=b"two")
    print("SAVE-RETURNED", flush=True)
    time.sleep(600)
    """
)


def _run_and_kill(tmp_path: Path, stage: str) -> Path:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    directory = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(directory), stage],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    marker = "SAVE-RETURNED" if stage == "orbax-writing" else "HANGING"
    deadline = time.time() + 120
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip() == marker:
                break
            assert time.time() < deadline, "child did not reach the kill point"
        else:
            pytest.fail(f"child exited ({proc.wait()}) before reaching {marker}")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return directory


@pytest.mark.parametrize("stage", ["orbax-writing", "before-rename"])
def test_sigkill_mid_save_leaves_previous_step(tmp_path, make_checkpointer, stage):
    directory = _run_and_kill(tmp_path, stage)
    ckpt = make_checkpointer(directory, keep_last_n=1)
    steps = ckpt.steps()
    target = {"w": jax.ShapeDtypeStruct((256, 256), jnp.float32)}
    if stage != "orbax-writing":
        assert steps == [1]
        assert (directory / "step_00000002.tmp").is_dir()  # The partial save, ignored.
    # Whatever the kill interrupted, step 1 is never lost and never half-visible.
    assert 1 in steps and set(steps) <= {1, 2}
    if steps == [1]:
        step, restored = ckpt.restore_latest(target)
        assert step == 1
        np.testing.assert_array_equal(np.asarray(restored["w"]), np.ones((256, 256), np.float32))
        assert ckpt.read_metadata(1).data_iterator_state == b"one"
    # The next save commits and clears the leftovers of the killed one.
    ckpt.save(3, {"w": jnp.zeros((256, 256))})
    ckpt.wait_until_finished()
    assert ckpt.steps() == [3]
    assert sorted(os.listdir(directory)) == ["step_00000003"]
