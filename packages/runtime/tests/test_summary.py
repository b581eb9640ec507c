"""The training terminal: plain numbers, progress lines that log records never land on,
eval lines, and the start lines of a real (toy) run."""

import io
import json
import logging
import re

import pytest
from toy import toy_trainer_config

from jaxlearn.runtime.summary import (
    SummaryWriter,
    format_flops,
    format_number,
    format_percent,
    progress_line,
)


@pytest.mark.parametrize("value, text", [
    (11610, "11.6k"), (1161.4, "1,161"), (2.34567, "2.346"), (0.00015, "0.00015"),
    (1.5e-5, "0.000015"), (3.2e9, "3.2B"), (123456, "123k"), (-3.5, "-3.5"), (0, "0"),
    (42, "42"), (0.5123, "0.5123"), (2.5e6, "2.5M"), (float("nan"), "nan"),
])
def test_numbers_are_plain(value, text):
    assert format_number(value) == text
    assert "e+" not in format_number(value) and "e-" not in format_number(value)


def test_percent_and_flops():
    assert [format_percent(f) for f in (0.314, 0.0314, 0.00031)] == ["31%", "3.1%", "0.031%"]
    assert format_flops(1.2e12) == "1.2 TFLOP" and format_flops(7.4e6) == "7.4 MFLOP"


def test_progress_line_names_the_mfu_peak():
    line = progress_line(5, 10, {"loss": 2.34567, "tokens_per_sec": 11610.0, "mfu": 0.314},
                         65.0, "cpu bf16 peak 1.2 TFLOP/s per device (catalogue)")
    assert line.startswith("step 5/10 [##########----------]")
    assert "loss 2.346" in line and "11.6k tok/s" in line
    assert "MFU 31% of cpu bf16 peak 1.2 TFLOP/s per device (catalogue)" in line
    assert line.endswith("ETA 1:05")


def test_progress_line_shows_the_reward_of_post_training():
    line = progress_line(3, 10, {"loss": 0.6, "reward_margin": 0.349, "reward_accuracy": 0.875},
                         10.0)
    assert "loss 0.6  reward margin 0.349  reward acc 0.875" in line
    assert "reward 1.5" in progress_line(3, 10, {"reward_mean": 1.5}, 1.0)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_log_records_never_land_on_the_progress_line():
    term = _Terminal()
    handler = logging.StreamHandler(term)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        writer = SummaryWriter.default_config().set(tensorboard=False, jsonl=False).instantiate(
            output_dir="", max_step=10, stream=term)
        writer.progress(1, {"loss": 3.0})
        logging.getLogger("jaxlearn.test").warning("a log record")
        writer.progress(2, {"loss": 2.5})
        writer.progress(3, {"loss": 2.0})
        writer.evaluation(3, {"loss": 2.25, "perplexity": 9.4877})
        writer.progress(4, {"loss": 1.5})
        writer.close()
        logging.getLogger("jaxlearn.test").warning("after close")
    finally:
        root.removeHandler(handler)
    lines = term.getvalue().split("\n")
    assert "a log record" in lines and "after close" in lines
    assert "eval at step 3: loss 2.25, perplexity 9.488" in lines
    for line in lines:  # A progress line and a message never share a line.
        assert not ("/10 [" in line and ("record" in line or "eval at" in line)), line
    assert not handler.filters  # The filter is gone after close.
    assert term.getvalue().endswith("after close\n")


def test_start_lines_and_eval_lines_of_a_run(tmp_path, capsys):
    from toy import ToyInput

    cfg = toy_trainer_config(str(tmp_path), max_step=4, log_every_n_steps=2,
                             eval_every_n_steps=2, eval_batches=1,
                             eval_input=ToyInput.default_config().set(seed=1),
                             peak_flops_per_device=1e12)
    cfg.summary_writer.set(progress=True, tensorboard=False)
    trainer = cfg.instantiate()
    trainer.run()
    err = capsys.readouterr().err
    count = trainer.parameter_count()
    assert count == 16 * 16  # The bigram table.
    assert f"model: {count:,} parameters" in err
    flops = re.search(r"train step: ([\d.]+) (k|M|G)?FLOP/token", err)
    assert flops is not None, err
    assert "MFU is measured against peak_flops_per_device 1 TFLOP/s (config)" in err
    assert re.search(r"eval at step 2: loss [\d.]+, perplexity [\d.]+\n", err), err
    assert "e+0" not in err and "e-0" not in err


def _events(path):
    """The Event protos of one TensorBoard event file (TFRecord framing)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    data, out, pos = path.read_bytes(), [], 0
    while pos < len(data):
        (n,) = struct.unpack("<Q", data[pos:pos + 8])
        out.append(Event.FromString(data[pos + 12:pos + 12 + n]))
        pos += 12 + n + 4
    return out


def test_resume_purges_redone_steps_from_jsonl_and_tensorboard(tmp_path):
    from tensorboardX.proto.event_pb2 import SessionLog

    cfg = SummaryWriter.default_config().set(progress=False)
    first = cfg.instantiate(output_dir=str(tmp_path), max_step=5)
    for step in range(1, 6):
        first.write(step, {"loss": float(step)})
    first.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "split": "tr')  # Torn by a kill mid-write.
    resumed = cfg.instantiate(output_dir=str(tmp_path), max_step=5, resumed_at=3)
    for step in (4, 5):
        resumed.write(step, {"loss": 10.0 + step})
    resumed.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0),
                                                       (4, 14.0), (5, 15.0)]
    files = sorted((tmp_path / "tensorboard").iterdir(), key=lambda p: p.stat().st_mtime)
    starts = [e.step for e in _events(files[-1])
              if e.HasField("session_log") and e.session_log.status == SessionLog.START]
    assert starts == [4]  # Readers drop the first file's events from step 4 on.
