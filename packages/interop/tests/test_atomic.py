"""`jaxlearn.interop.atomic`: exports write into a hidden temp of their own and rename it
into place; what a killed writer leaves never breaks the next export, and the previous
output stays whole until the new one replaces it."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from jaxlearn.interop import InteropError
from jaxlearn.interop.atomic import prepare_output, write_atomically


def _dead_pid():
    """The pid of a process that has exited and been reaped."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _leftover(target, pid, suffix, host=None):
    """The name a writer with `pid` on this host gives its temp (or aside) of `target`."""
    from jaxlearn.interop.atomic import _host

    return target.with_name(f".{target.name}.{host or _host()}.{pid}.0123abcd.{suffix}")


def test_temps_are_hidden_unique_and_carry_the_pid(tmp_path):
    target = tmp_path / "m.gguf"
    with write_atomically(target, kind="file", overwrite=True) as a:
        a.write_bytes(b"first")
        with write_atomically(target, kind="file", overwrite=True) as b:
            b.write_bytes(b"second")
            assert a != b and a.parent == b.parent == tmp_path
            for t in (a, b):
                assert t.name.startswith(".m.gguf.") and f".{os.getpid()}." in t.name
            assert not target.exists()  # nothing appears before a writer finishes
        assert target.read_bytes() == b"second"
    assert target.read_bytes() == b"first"  # the writer that finished last wins
    with pytest.raises(InteropError, match="m.gguf: already exists and is not empty; the new "
                                           "output was dropped"):
        with write_atomically(target, kind="file") as c:
            c.write_bytes(b"third")
    assert target.read_bytes() == b"first"
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_a_failed_write_leaves_the_old_output_and_no_temp(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old").write_text("old")
    with pytest.raises(RuntimeError, match="boom"):
        with write_atomically(target, kind="dir", overwrite=True) as tmp:
            (tmp / "new").write_text("new")
            raise RuntimeError("boom")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert [p.name for p in target.iterdir()] == ["old"]


def test_directory_overwrite_replaces_the_old_one_whole(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    for name in ("model.safetensors.index.json", "model-00001-of-00002.safetensors"):
        (target / name).write_text("old")
    with write_atomically(target, kind="dir", overwrite=True) as tmp:
        (tmp / "model.safetensors").write_text("new")
    assert [p.name for p in target.iterdir()] == ["model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_symlinked_target_is_written_where_it_points(tmp_path):
    real = tmp_path / "disk" / "out"
    real.mkdir(parents=True)
    (real / "old").write_text("old")
    (tmp_path / "link").symlink_to(real)
    with write_atomically(tmp_path / "link", kind="dir", overwrite=True) as tmp:
        assert tmp.parent == real.parent
        (tmp / "new").write_text("new")
    assert (tmp_path / "link").is_symlink()
    assert [p.name for p in real.iterdir()] == ["new"]


def test_stale_leftovers_of_dead_writers_are_removed_live_ones_kept(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "config.json").write_text("old")
    dead, live = _dead_pid(), os.getppid()
    stale_dir = _leftover(target, dead, "tmp")
    stale_dir.mkdir()
    (stale_dir / "model.safetensors").write_bytes(b"\0" * 1000)
    stale_aside = _leftover(target, dead, "old")
    stale_aside.mkdir()
    live_tmp = _leftover(target, live, "tmp")
    live_tmp.mkdir()
    other_host = _leftover(target, dead, "tmp", host="elsewhere")
    other_host.mkdir()
    unrelated = tmp_path / ".outer.x.1.0123abcd.tmp"
    unrelated.write_text("not ours")
    prepare_output(target, kind="dir", overwrite=True)
    assert not stale_dir.exists() and not stale_aside.exists()
    assert live_tmp.exists() and other_host.exists() and unrelated.exists()
    assert (target / "config.json").read_text() == "old"


def test_an_interrupted_swap_puts_the_old_output_back(tmp_path):
    """Killed between moving the old directory aside and renaming the new one in: the
    target is absent; the next export puts the old one back first (and so refuses to
    replace it without overwrite)."""
    target = tmp_path / "out"
    aside = _leftover(target, _dead_pid(), "old")
    aside.mkdir()
    (aside / "config.json").write_text("old")
    with pytest.raises(InteropError, match="already exists and is not empty"):
        prepare_output(target, kind="dir")
    assert not aside.exists() and (target / "config.json").read_text() == "old"


def test_a_writer_killed_mid_write_leaves_the_old_output(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "config.json").write_text("old")
    code = textwrap.dedent(f"""
        import sys, time
        from jaxlearn.interop.atomic import write_atomically
        with write_atomically({str(target)!r}, kind="dir", overwrite=True) as tmp:
            (tmp / "config.json").write_text("half")
            print("writing", flush=True)
            time.sleep(120)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                          env=env) as proc:
        try:
            assert proc.stdout.readline() == b"writing\n"
        finally:
            proc.send_signal(signal.SIGKILL)
    left = [p for p in tmp_path.iterdir() if p.name != "out"]
    assert len(left) == 1 and f".{proc.pid}." in left[0].name
    assert [p.name for p in target.iterdir()] == ["config.json"]
    assert (target / "config.json").read_text() == "old"
    with write_atomically(target, kind="dir", overwrite=True) as tmp:
        (tmp / "config.json").write_text("new")
    assert (target / "config.json").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("kind,make,message", [
    ("file", lambda p: p.mkdir(), "is an existing directory, but the export writes one file"),
    ("dir", lambda p: p.write_text("x"), "is an existing file, but the export writes a dir"),
    ("dir", lambda p: (p.mkdir(), (p / "a").write_text("x")), "pass --overwrite to replace"),
])
def test_refusals_name_the_target(tmp_path, kind, make, message):
    target = tmp_path / "t"
    make(target)
    with pytest.raises(InteropError, match=message) as e:
        prepare_output(target, kind=kind, label="--output t", overwrite_flag="--overwrite")
    assert str(e.value).startswith("--output t: ") and "\n" not in str(e.value)
