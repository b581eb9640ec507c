"""A toy training run as a child process, for the fault-injection tests and the report.

    python resilience_child.py OUTPUT_DIR [--set path=value ...] [--elastic]
                               [--distributed PORT PROCESS_ID NUM_PROCESSES]

Trains the toy bigram model (toy.py) with checkpoints, eval and the resilience hooks,
resuming from OUTPUT_DIR; faults come from `--set resilience.faults=SPEC`, `--elastic`
sets `resilience.elastic`; the device count from
JAX_NUM_CPU_DEVICES (default 8; per process with `--distributed`, which joins a
jax.distributed job on 127.0.0.1:PORT with gloo CPU collectives). Writes
OUTPUT_DIR/final_params.npz at the end (process 0) and exits with the status `jaxlearn
train` would use (failures.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))


def child_config(output_dir: str, overrides: Sequence[str] = ()) -> Any:
    """The fault-injection suite's run: 12 steps, saves every 3, eval every 4."""
    sys.path.insert(0, HERE)
    from toy import ToyInput, toy_trainer_config

    from jaxlearn.checkpoint import Checkpointer
    from jaxlearn.config import apply_overrides

    cfg = toy_trainer_config(
        output_dir, max_step=12, save_every_n_steps=3, log_every_n_steps=1,
        eval_every_n_steps=4, eval_batches=2, eval_input=ToyInput.default_config().set(seed=1),
        checkpointer=Checkpointer.default_config(),
    )
    cfg.learner.total_steps = 12
    cfg.resilience.goodput_flush_every_s = 0.0  # Every step: exact records for the report.
    apply_overrides(cfg, list(overrides))
    return cfg


def flat_params(tree: Any) -> dict[str, Any]:
    import jax
    import numpy as np

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(kp): np.asarray(v) for kp, v in flat}


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--elastic", action="store_true")
    parser.add_argument("--distributed", nargs=3, type=int, default=None,
                        metavar=("PORT", "PROCESS_ID", "NUM_PROCESSES"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("absl", "jax._src", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    import jax

    jax.config.update("jax_num_cpu_devices", int(os.environ.get("JAX_NUM_CPU_DEVICES", "8")))
    jax.config.update("jax_compilation_cache_dir",
                      os.environ.get("JAXLEARN_COMPILATION_CACHE") or "/tmp/jaxlearn-jax-cache")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    if args.distributed:
        port, process_id, num_processes = args.distributed
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                                   num_processes=num_processes, process_id=process_id,
                                   initialization_timeout=120, heartbeat_timeout_seconds=60)
    import numpy as np

    from jaxlearn.checkpoint import CheckpointStructureError
    from jaxlearn.resilience.elastic import adapt_to_devices
    from jaxlearn.resilience.failures import EXIT_USAGE, Preempted, ResilienceError
    from jaxlearn.resilience.manager import CheckpointSaveFailed

    cfg = child_config(args.output_dir,
                       [*args.overrides, *(["resilience.elastic=True"] if args.elastic else [])])
    decision = adapt_to_devices(cfg) if cfg.resilience.elastic else None
    trainer = cfg.instantiate()
    if decision is not None:
        decision.record()
    print(f"child: {jax.device_count()} devices, mesh {dict(trainer.mesh.shape)}, "
          f"num_microbatches {trainer.learner.config.num_microbatches}", file=sys.stderr,
          flush=True)
    try:
        state = trainer.run().state
    except Preempted as e:
        print(f"child: stopped: {e}", file=sys.stderr)
        return e.exit_code
    except ResilienceError as e:
        print(f"child: error: {e}", file=sys.stderr)
        return e.exit_code
    except CheckpointStructureError as e:
        print(f"child: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except CheckpointSaveFailed as e:
        print(f"child: error: {e}", file=sys.stderr)
        return 1
    if jax.process_index() != 0:
        return 0
    np.savez(os.path.join(args.output_dir, "final_params.npz"),
             **flat_params({"params": state["params"], "opt_state": state["opt_state"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
