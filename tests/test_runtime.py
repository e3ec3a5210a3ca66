"""lrdsl.load and its content-addressed cache."""
from __future__ import annotations

import os

import pytest

import lrdsl
from lrdsl.errors import LrdslError
from lrdsl.runtime import cache, loader

from helpers import spec_path


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LRDSL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "_loaded", {})
    return tmp_path / "cache"


def test_load_writes_one_module_per_key(private_cache):
    first = lrdsl.load(spec_path("gdn"))
    files = list(private_cache.glob("*.py"))
    assert len(files) == 1 and files[0].name.startswith("gdn_")
    assert lrdsl.load(spec_path("gdn")) is first
    assert not list(private_cache.glob(".*.tmp")), "atomic writes leave no temporary files"


def test_cached_file_is_reused_across_processes(private_cache):
    lrdsl.load(spec_path("deltanet"))
    (file,) = private_cache.glob("*.py")
    stamp = file.stat().st_mtime_ns
    loader._loaded.clear()  # as if in a new process
    lrdsl.load(spec_path("deltanet"))
    assert file.stat().st_mtime_ns == stamp


def test_different_specs_different_keys(private_cache):
    lrdsl.load(spec_path("gdn"))
    lrdsl.load(spec_path("simple_gla"))
    assert len(list(private_cache.glob("*.py"))) == 2


def test_key_covers_ir_options_and_source(monkeypatch):
    base = cache.cache_key("ir", {})
    assert cache.cache_key("ir2", {}) != base
    assert cache.cache_key("ir", {"x": 1}) != base
    monkeypatch.setattr(cache, "source_fingerprint", lambda: "changed")
    assert cache.cache_key("ir", {}) != base


def test_same_recurrence_from_two_files_shares_a_key(private_cache, tmp_path):
    copy = tmp_path / "copy.toml"
    copy.write_text("# a comment changes nothing\n" + open(spec_path("gdn")).read())
    lrdsl.load(spec_path("gdn"))
    lrdsl.load(str(copy))
    assert len(list(private_cache.glob("*.py"))) == 1


def test_dump_dir(private_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("LRDSL_DUMP", str(tmp_path / "dump"))
    lrdsl.load(spec_path("linear_attn"))
    assert len(list((tmp_path / "dump").glob("linear_attn_*.py"))) == 1


def test_dump_dir_on_a_cache_hit(private_cache, tmp_path, monkeypatch):
    """LRDSL_DUMP set after the module was cached (by another process) still gets the module:
    the text `lrdsl compile` writes, without the cache's digest line."""
    lrdsl.load(spec_path("linear_attn"))
    loader._loaded.clear()  # a new process, finding the entry on disk
    monkeypatch.setenv("LRDSL_DUMP", str(tmp_path / "dump"))
    lrdsl.load(spec_path("linear_attn"))
    (dumped,) = (tmp_path / "dump").glob("linear_attn_*.py")
    assert dumped.read_text() == loader.generate(spec_path("linear_attn"))[0]


@pytest.fixture
def umask():
    """umask(value) for the rest of the test; the old one comes back after it."""
    previous = os.umask(0o022)
    os.umask(previous)
    yield os.umask
    os.umask(previous)


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_honour_the_umask(mask, mode, umask, private_cache, tmp_path):
    umask(mask)
    cache.atomic_write(tmp_path / "m.py", "x = 1\n")
    lrdsl.load(spec_path("linear_attn"))
    (entry,) = private_cache.glob("*.py")
    for path in (tmp_path / "m.py", entry):
        assert oct(path.stat().st_mode & 0o777) == oct(mode), path


def test_unknown_option():
    """The loader's options (none yet; they would join the cache key) are refused by name; the
    public lrdsl.load takes none, so Python itself names an unexpected one."""
    from lrdsl.runtime.loader import load

    with pytest.raises(LrdslError, match="unknown option 'fast'"):
        load(spec_path("gdn"), fast=True)
    with pytest.raises(TypeError, match="'fast'"):
        lrdsl.load(spec_path("gdn"), fast=True)


def test_atomic_write_keeps_old_file_on_failure(tmp_path):
    target = tmp_path / "m.py"
    cache.atomic_write(target, "old")
    with pytest.raises(TypeError):
        cache.atomic_write(target, 42)  # not text: fails mid-write
    assert target.read_text() == "old"
    assert not list(tmp_path.glob(".m.py.*"))
