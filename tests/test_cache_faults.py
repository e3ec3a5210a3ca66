"""The module cache under faults it does not cause: damaged or unreadable entries, a cache directory
that cannot be written, several processes filling one entry at once.

Each damaged entry must be treated as a miss: regenerated with one warning line, never a
traceback, and the module then works (checked against the float64 oracle).
"""
from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import threading
from pathlib import Path

import pytest
import torch

import lrdsl
from lrdsl import reference
from lrdsl.runtime import cache, loader
from lrdsl.verification.workloads import Shape, make_inputs

from helpers import assert_close, recurrence, spec_path

SPEC = "linear_attn"  # the cheapest module to generate and run; damage does not depend on the spec


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LRDSL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "_loaded", {})
    monkeypatch.setattr(cache, "_fallback_dirs", {})
    return tmp_path / "cache"


def fresh_process_load():
    """lrdsl.load as a new process would do it: nothing remembered in memory."""
    loader._loaded.clear()
    return lrdsl.load(spec_path(SPEC))


def fresh_process_load_of(name: str):
    loader._loaded.clear()
    return lrdsl.load(spec_path(name))


def the_entry(directory: Path) -> Path:
    (entry,) = directory.glob(f"{SPEC}_*.py")
    return entry


def assert_module_works(module, generator):
    rec = recurrence(SPEC)
    tensors = make_inputs(rec, Shape(1, 5, 1, 2, 8, 8), generator=generator)
    o, ht = module.recurrent(*tensors, output_final_state=True)
    ref_o, ref_ht = reference.run(rec, *tensors, output_final_state=True)
    assert_close(o, ref_o, torch.float32, "o of the regenerated module")
    assert_close(ht, ref_ht, torch.float32, "final state of the regenerated module")


def warnings_in(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def truncate(entry: Path):
    data = entry.read_bytes()
    entry.write_bytes(data[: len(data) // 2])  # a copy cut short: SyntaxError when imported as is


def empty(entry: Path):
    entry.write_bytes(b"")  # a full disk: the module would import with no functions at all


def edit(entry: Path):
    # a stray edit that still parses: the public function is renamed away
    entry.write_text(entry.read_text().replace("def recurrent(", "def recurrent_(", 1))


def drop_digest_line(entry: Path):
    entry.write_text("".join(entry.read_text().splitlines(keepends=True)[:-1]))


def make_unreadable(entry: Path):
    # a symlink pointing at itself cannot be opened, by root either (chmod 000 would not stop root)
    entry.unlink()
    entry.symlink_to(entry.name)


def another_specs_entry(entry: Path):
    """A sound entry of another spec copied onto this one's file name: its digest holds, its key
    does not (it was imported as this spec, silently, when entries recorded no key)."""
    loader._loaded.clear()
    lrdsl.load(spec_path("deltanet"))
    (other,) = entry.parent.glob("deltanet_*.py")
    shutil.copyfile(other, entry)


DAMAGES = {
    "truncated": (truncate, "truncated or edited"),
    "empty": (empty, "is empty"),
    "edited": (edit, "truncated or edited"),
    "digest_line_removed": (drop_digest_line, "truncated or edited"),
    "unreadable": (make_unreadable, "unreadable"),
    "another_specs_entry": (another_specs_entry, "filed under the wrong key"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_entry_is_regenerated_with_one_warning(damage, private_cache, capfd, generator):
    fresh_process_load()
    entry = the_entry(private_cache)
    capfd.readouterr()
    harm, why = DAMAGES[damage]
    harm(entry)

    module = fresh_process_load()

    lines = warnings_in(capfd.readouterr().err)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"lrdsl: warning: cache entry {entry} ") and why in lines[0], lines[0]
    assert lines[0].endswith("regenerating it")
    assert not entry.is_symlink() and cache.parse_entry(entry.read_bytes()).source is not None, "sound again"
    assert_module_works(module, generator)
    fresh_process_load()  # and the next process finds it sound: no warning
    assert capfd.readouterr().err == ""


def test_sound_entry_loads_silently_and_leaves_no_bytecode(private_cache, capfd):
    fresh_process_load()
    capfd.readouterr()
    entry = the_entry(private_cache)
    stamp = entry.stat().st_mtime_ns
    fresh_process_load()
    assert capfd.readouterr().err == ""
    assert entry.stat().st_mtime_ns == stamp, "a sound entry is not rewritten"
    # modules run from the checked text, never from a __pycache__ that could be damaged in turn
    assert not (private_cache / "__pycache__").exists()


def test_entry_records_its_key_and_the_digest_of_its_contents(private_cache):
    module = fresh_process_load()
    entry = the_entry(private_cache)
    key = next(key for key, loaded in loader._loaded.items() if loaded is module)
    source, problem = cache.read_entry(entry, key)
    assert problem is None
    assert entry.read_text() == cache.entry_text(source, key)
    *_, key_line, digest_line = entry.read_text().splitlines()
    assert key_line == f"# lrdsl cache entry key={key} build={cache.build_fingerprint()}"
    assert digest_line.startswith("# lrdsl cache entry sha256=")


def test_unwritable_cache_directory_falls_back_to_a_private_one(tmp_path, monkeypatch, capfd, generator):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    configured = blocker / "cache"  # cannot be created, by root either
    monkeypatch.setenv("LRDSL_CACHE_DIR", str(configured))
    monkeypatch.setattr(loader, "_loaded", {})
    monkeypatch.setattr(cache, "_fallback_dirs", {})

    module = lrdsl.load(spec_path(SPEC))
    lrdsl.load(spec_path("deltanet"))  # a second entry: no second warning

    lines = warnings_in(capfd.readouterr().err)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"lrdsl: warning: cannot write the module cache {configured} ")
    private = cache._fallback_dirs[configured]
    assert f"using {private} for this process" in lines[0]
    assert oct(private.stat().st_mode & 0o777) == oct(0o700), "the fallback directory is private"
    assert len(list(private.glob("*.py"))) == 2
    assert_module_works(module, generator)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory anyway")
def test_read_only_cache_directory_falls_back(tmp_path, monkeypatch, capfd):
    configured = tmp_path / "cache"
    configured.mkdir()
    configured.chmod(0o500)
    monkeypatch.setenv("LRDSL_CACHE_DIR", str(configured))
    monkeypatch.setattr(loader, "_loaded", {})
    monkeypatch.setattr(cache, "_fallback_dirs", {})
    try:
        lrdsl.load(spec_path(SPEC))
    finally:
        configured.chmod(0o700)
    lines = warnings_in(capfd.readouterr().err)
    assert len(lines) == 1 and "cannot write the module cache" in lines[0], lines


def _load_in_child(barrier, spec: str, stderr_path: str) -> None:
    """A forked process (its imports done, its own memory): load once every process has missed."""
    os.dup2(os.open(stderr_path, os.O_WRONLY | os.O_CREAT), 2)
    loader._loaded.clear()
    store = cache.store_entry

    def store_once_all_missed(*args):
        barrier.wait(timeout=120)  # every process has looked and found no entry: all write at once
        return store(*args)

    cache.store_entry = store_once_all_missed
    module = lrdsl.load(spec)
    assert callable(module.chunk) and callable(module.recurrent)


def test_processes_filling_one_entry_at_once_leave_one_sound_entry(private_cache, tmp_path):
    """Several processes miss on the same entry and write it at the same moment, each atomically:
    what stays is one sound entry, and every process imported a whole module without a warning.
    (Forked, so that no process spends the test importing torch.)"""
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(3)
    stderr_paths = [str(tmp_path / f"stderr{i}") for i in range(3)]
    processes = [context.Process(target=_load_in_child, args=(barrier, spec_path("gdn"), path)) for path in stderr_paths]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=600)
    assert [p.exitcode for p in processes] == [0, 0, 0]
    assert all(Path(path).read_text() == "" for path in stderr_paths), "no warning: no process saw a damaged entry"
    entries = list(private_cache.glob("*.py"))
    assert len(entries) == 1, entries
    assert cache.parse_entry(entries[0].read_bytes()).damage is None
    assert not list(private_cache.glob(".*.tmp")), "no temporary file is left behind"


# -- threads ------------------------------------------------------------------------------------

THREADS = 6


def _load_from_threads(spec: str) -> tuple[list, list]:
    """lrdsl.load(spec) from THREADS threads released at one moment: (modules, exceptions)."""
    barrier = threading.Barrier(THREADS)
    modules, failures = [None] * THREADS, [None] * THREADS

    def load(i):
        barrier.wait(timeout=60)
        try:
            modules[i] = lrdsl.load(spec)
        except BaseException as exc:  # noqa: BLE001 - the test reports what each thread raised
            failures[i] = exc

    threads = [threading.Thread(target=load, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    return modules, failures


@pytest.mark.parametrize("cache_state", ["cold", "warm"])
def test_threads_loading_one_spec_at_once_get_one_module(cache_state, private_cache, monkeypatch, capfd, generator):
    """Cold: no entry on disk; warm: an entry another process wrote, nothing loaded in this one.
    Every thread gets the same module, imported (custom ops registered) once, and it stays in
    sys.modules: its ops and torch.compile find it there."""
    if cache_state == "warm":
        fresh_process_load_of("gdn")
        loader._loaded.clear()
    imports = []
    import_file = loader.import_file

    def counted_import(*args):
        imports.append(args[1])
        return import_file(*args)

    monkeypatch.setattr(loader, "import_file", counted_import)
    capfd.readouterr()

    modules, failures = _load_from_threads("gdn")

    assert failures == [None] * THREADS, failures
    assert len({id(module) for module in modules}) == 1, "every thread gets the same module"
    assert len(imports) == 1, f"imported {len(imports)} times"
    module = modules[0]
    assert sys.modules[module.__name__] is module
    assert capfd.readouterr().err == ""
    # the registered custom op, called through the dispatcher as torch.compile calls it
    rec = recurrence("gdn")
    tensors = make_inputs(rec, Shape(1, 5, 1, 2, 8, 8), generator=generator)
    o, ht = module._compiled_recurrent(tensors, None, None, True, None, False, False, None, None, True, None)
    ref_o, ref_ht = reference.run(rec, *tensors, output_final_state=True)
    assert_close(o, ref_o, torch.float32, "o through the custom op")
    assert_close(ht, ref_ht, torch.float32, "final state through the custom op")


def test_threads_loading_different_specs_do_not_wait_on_one_lock(private_cache, monkeypatch):
    """The lock is per key: a thread stuck importing one spec does not hold up another spec."""
    first_importing, release = threading.Event(), threading.Event()
    import_file = loader.import_file

    def slow_for_linear_attn(file, name, source=None):
        if "linear_attn" in name:
            first_importing.set()
            assert release.wait(timeout=300)
        return import_file(file, name, source)

    monkeypatch.setattr(loader, "import_file", slow_for_linear_attn)
    slow = threading.Thread(target=lrdsl.load, args=("linear_attn",))
    slow.start()
    try:
        assert first_importing.wait(timeout=300)
        assert callable(lrdsl.load("deltanet").recurrent)  # would deadlock behind one global lock
    finally:
        release.set()
        slow.join(timeout=300)


def test_a_failed_import_leaves_another_import_of_that_name_in_place(tmp_path):
    """A module that fails to import removes itself from sys.modules, never a module another
    import registered under that name (a failing thread once deleted the winner's module)."""
    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_text("VALUE = 1\n")
    bad.write_text("raise RuntimeError('broken')\n")
    name = "lrdsl_test_shared_name"
    winner = loader.import_file(good, name)
    try:
        with pytest.raises(RuntimeError, match="broken"):
            loader.import_file(bad, name)
        assert sys.modules[name] is winner
    finally:
        sys.modules.pop(name, None)


# -- how the spec was named ---------------------------------------------------------------------

def test_entry_bytes_do_not_depend_on_how_the_spec_was_named(tmp_path, monkeypatch):
    """A shipped name, a relative path, an absolute path and a copy under a file name UTF-8 cannot
    encode (Latin-1 bytes) give one key and byte-identical entries: the path is not in the text."""
    copy = os.fsdecode(os.fsencode(tmp_path) + b"/sp\xe9c.toml")
    Path(copy).write_bytes(Path(spec_path(SPEC)).read_bytes())
    monkeypatch.chdir(Path(spec_path(SPEC)).parent.parent)
    entries = {}
    for naming in (SPEC, f"specs/{SPEC}.toml", spec_path(SPEC), copy):
        directory = tmp_path / f"cache{len(entries)}"
        monkeypatch.setenv("LRDSL_CACHE_DIR", str(directory))
        monkeypatch.setattr(loader, "_loaded", {})
        assert callable(lrdsl.load(naming).recurrent)
        entry = the_entry(directory)
        entries[naming] = (entry.name, entry.read_bytes())
    assert len(set(entries.values())) == 1, {naming: name for naming, (name, _) in entries.items()}


# -- LRDSL_DUMP ---------------------------------------------------------------------------------

def test_unwritable_dump_directory_warns_once_and_still_loads(private_cache, tmp_path, monkeypatch, capfd,
                                                              generator):
    """The module compiled and cached fine: a dump directory that cannot be written (here its
    parent is a file, which stops root too) costs one warning per process, not the load."""
    (tmp_path / "a_file").write_text("")
    dump = tmp_path / "a_file" / "dump"
    monkeypatch.setenv("LRDSL_DUMP", str(dump))  # a new directory: this process has not warned of it

    module = lrdsl.load(spec_path(SPEC))
    lrdsl.load(spec_path("deltanet"))  # a second module: no second warning

    lines = warnings_in(capfd.readouterr().err)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"lrdsl: warning: cannot write LRDSL_DUMP={dump} ("), lines[0]
    assert_module_works(module, generator)
