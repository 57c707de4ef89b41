"""The C-kernel cache against another user (fedlap_privacy.compute.kernels.build, issue 33 item 4).

A library loaded with ctypes runs with the caller's rights, so each attack below plants a
library whose constructor writes a marker file: the exploit succeeds where the marker
appears. The cache directory is used only where every component of its path is one no
other user can change (owned by the caller or root, not writable by others except a sticky
ancestor such as /tmp, no symbolic link that root does not own); an unsafe one is refused
with one warning and the kernels are built in a private temporary directory instead. The
library is verified against the SHA-256 recorded at its build before it is loaded, and
loaded from a private copy of the verified bytes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fedlap_privacy.compute import fast_paths
from fedlap_privacy.compute.kernels import build as kbuild
from fedlap_privacy.compute.kernels import gn_relu_pool, load_kernels, reference_block
from fedlap_privacy.errors import ConfigError

_EVIL = """#include <stdio.h>
__attribute__((constructor)) static void pwn(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("attacker's code ran", f); fclose(f); }
}
"""


@pytest.fixture(autouse=True)
def _fresh_load() -> Iterator[None]:
    """Each test builds and loads afresh (the load is cached per process), kernels required."""
    if not fast_paths.current().kernels:
        pytest.skip("the kernels are switched off (FEDLAP_KERNELS, FEDLAP_FAST_PATHS)")
    kbuild._load.cache_clear()
    kbuild._warn_fallback.cache_clear()
    with fast_paths.using(require_kernels=True):
        yield
    kbuild._load.cache_clear()
    kbuild._warn_fallback.cache_clear()


def _evil_library(tmp_path: Path) -> tuple[Path, Path]:
    """An attacker's shared library and the marker its constructor writes when loaded."""
    marker = tmp_path / "pwned"
    out = tmp_path / "evil.so"
    compiler = os.environ.get("CC") or "cc"
    subprocess.run([compiler, "-shared", "-fPIC", f'-DMARKER="{marker}"', "-x", "c", "-",
                    "-o", str(out)], input=_EVIL, text=True, check=True, capture_output=True)
    return out, marker


def _works(library: kbuild.KernelLibrary | None) -> None:
    """The loaded library is the package's kernels: they compute torch's block."""
    assert library is not None
    z, w, b = torch.randn(2, 3, 4, 4), torch.rand(3) + 0.5, torch.randn(3)
    torch.testing.assert_close(gn_relu_pool(z, w, b, 1e-5), reference_block(z, w, b, 1e-5))


def _libraries(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.so")) if folder.exists() else []


def _refused(cache: Path, match: str) -> kbuild.KernelLibrary:
    """Loads the kernels with ``cache`` configured; checks it was refused with one warning."""
    with pytest.warns(RuntimeWarning, match=match) as caught:
        library = load_kernels()
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    assert str(cache) in str(caught[0].message)
    _works(library)
    assert library is not None and cache not in library.path.parents
    assert _libraries(cache) == []  # nothing built into, or loaded from, the refused cache
    return library


@pytest.mark.parametrize("writable", ["kernels", "cache", "parent"])
@pytest.mark.parametrize("mode", [0o777, 0o770], ids=["world", "group"])
def test_a_cache_others_can_write_to_or_whose_ancestor_they_can_is_refused(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, writable: str, mode: int):
    """Where another user can rename ``kernels/`` (or a folder above it) they can put their
    library where the victim loads it: such a cache is not used, however private its own
    leaf looks."""
    cache = tmp_path / "parent" / "cache"
    (cache / "kernels").mkdir(parents=True, mode=0o700)
    {"kernels": cache / "kernels", "cache": cache, "parent": cache.parent}[writable].chmod(mode)
    monkeypatch.setenv(kbuild.CACHE_ENV, str(cache))
    _refused(cache, "writable by other users")


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a folder away")
@pytest.mark.parametrize("owned", ["kernels", "parent"])
def test_a_cache_another_user_owns_or_whose_ancestor_they_own_is_refused(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, owned: str):
    """The owner of a folder can rename anything in it, whatever its mode."""
    cache = tmp_path / "parent" / "cache"
    (cache / "kernels").mkdir(parents=True, mode=0o700)
    os.chown(cache / "kernels" if owned == "kernels" else cache.parent, 65534, 65534)
    monkeypatch.setenv(kbuild.CACHE_ENV, str(cache))
    _refused(cache, "belongs to another user")


def test_a_sticky_ancestor_like_tmp_is_allowed(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path):
    """In a sticky folder others can write to, only the owner renames an entry: /tmp's
    case. The cache below it is used (and created private)."""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    monkeypatch.setenv(kbuild.CACHE_ENV, str(sticky / "cache"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        library = load_kernels()
    _works(library)
    assert library is not None and library.path.parent == sticky / "cache" / "kernels"
    assert (sticky / "cache" / "kernels").stat().st_mode & 0o077 == 0


def test_a_sticky_cache_directory_itself_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path):
    shared = tmp_path / "cache"
    (shared / "kernels").mkdir(parents=True)
    (shared / "kernels").chmod(0o1777)
    monkeypatch.setenv(kbuild.CACHE_ENV, str(shared))
    _refused(shared, "writable by other users")


def _attackers_link(link: Path, target: Path) -> None:
    """A symbolic link as another user would plant it (root can give it away; anyone
    else's own links are refused as well)."""
    link.symlink_to(target)
    if os.geteuid() == 0:
        os.lchown(link, 65534, 65534)


@pytest.mark.parametrize("where", ["cache", "kernels"])
def test_a_symlinked_component_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                          where: str):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    cache = tmp_path / "cache"
    if where == "cache":
        _attackers_link(cache, elsewhere)
    else:
        cache.mkdir(mode=0o700)
        _attackers_link(cache / "kernels", elsewhere)
    monkeypatch.setenv(kbuild.CACHE_ENV, str(cache))
    _refused(cache, "symbolic link")
    assert _libraries(elsewhere) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can own a link it did not make")
def test_a_link_root_owns_is_followed_and_its_target_checked(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path):
    """The system's own links (macOS's /tmp, a cluster's /home) are root's: followed, and
    the folders they lead to checked like any other."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to("real")
    monkeypatch.setenv(kbuild.CACHE_ENV, str(tmp_path / "link" / "cache"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _works(load_kernels())
    assert len(_libraries(real / "cache" / "kernels")) == 1
    kbuild._load.cache_clear()
    shutil.rmtree(real / "cache")
    real.chmod(0o777)
    _refused(tmp_path / "link" / "cache", "real is writable by other users")


@pytest.mark.parametrize(("swap", "match"), [
    ("bytes", "does not match the SHA-256 recorded at its build"),
    ("link", "Too many levels of symbolic links"),
])
def test_a_swapped_library_is_detected_and_not_loaded(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path, swap: str, match: str):
    """Different bytes at the cached library's path, or a link there to another library (in
    an earlier process's cache, copied, so that this process has not loaded that path yet):
    the hash no longer matches the one recorded at the build, or the link is not followed,
    so the library is built again, never loaded."""
    monkeypatch.setenv(kbuild.CACHE_ENV, str(tmp_path / "first"))
    first = load_kernels()
    assert first is not None
    shutil.copytree(tmp_path / "first", tmp_path / "cache")
    cached = tmp_path / "cache" / "kernels" / first.path.name
    evil, marker = _evil_library(tmp_path)
    if swap == "bytes":
        os.replace(evil, cached)
    else:
        cached.unlink()
        cached.symlink_to(evil)
    kbuild._load.cache_clear()
    monkeypatch.setenv(kbuild.CACHE_ENV, str(tmp_path / "cache"))
    try:
        with pytest.warns(RuntimeWarning, match=match):
            library = load_kernels()
    finally:
        assert not marker.exists(), "the swapped library was loaded"
    _works(library)
    assert library is not None and library.path == cached
    assert not cached.is_symlink() and cached.read_bytes() == first.path.read_bytes()


def test_a_cache_directory_swapped_during_the_compile_is_not_loaded_from(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """The issue's race: while the compiler runs, ``kernels/`` is renamed and a folder
    holding the attacker's library, at every name the build writes, takes its place. The
    build writes, renames and loads through the descriptor of the folder it checked."""
    cache = tmp_path / "cache"
    kernels = cache / "kernels"
    monkeypatch.setenv(kbuild.CACHE_ENV, str(cache))
    evil, marker = _evil_library(tmp_path)
    real_run = subprocess.run

    def compile_then_swap(cmd, *args, **kwargs):
        done = real_run(cmd, *args, **kwargs)
        if (cache / "kernels.moved").exists():
            return done
        output = Path(cmd[cmd.index("-o") + 1])
        kernels.rename(cache / "kernels.moved")
        planted = kernels / output.relative_to(kernels)
        planted.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(evil, planted)
        for name in os.listdir(cache / "kernels.moved"):  # every name already there
            if not (kernels / name).exists():
                shutil.copy(evil, kernels / name)
        return done

    monkeypatch.setattr(kbuild.subprocess, "run", compile_then_swap)
    try:
        library = load_kernels()
    finally:
        assert not marker.exists(), "the attacker's library was loaded"
    _works(library)


def test_an_unsafe_cache_and_temporary_directory_fail_require_in_one_line(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv(kbuild.CACHE_ENV, str(shared / "cache"))
    monkeypatch.setattr("tempfile.tempdir", str(shared))
    with pytest.warns(RuntimeWarning, match="does not cache"):
        with pytest.raises(ConfigError, match=r"could not be built: .*writable by other users"
                           ) as raised:
            load_kernels()
    assert "\n" not in str(raised.value)
    assert _libraries(shared) == []


def test_the_manifest_records_the_librarys_sha256_and_nothing_is_left_behind(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv(kbuild.CACHE_ENV, str(tmp_path))
    library = load_kernels()
    _works(library)
    assert library is not None
    digest = hashlib.sha256(library.path.read_bytes()).hexdigest()
    manifests = sorted((tmp_path / "kernels").glob("*.sha256"))
    assert [m.read_text() for m in manifests] == [f"{digest}  {library.path.name}\n"]
    assert sorted(p.name for p in (tmp_path / "kernels").iterdir()) == sorted(
        [library.path.name, manifests[0].name])


def test_sources_planted_in_the_working_folder_are_never_compiled_in(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Another user leaves ``gn_relu_pool.c`` (and every other source's name) in a shared
    folder the victim runs ``train`` from: each plant is the genuine source plus a
    constructor that writes a marker, so a build that compiled it in would work and cache
    it under the genuine key. The build reads only the package's sources, copied into its
    private directory and compiled by path there, and the copies are the bytes the key
    hashes."""
    shared, marker = tmp_path / "shared", tmp_path / "pwned"
    shared.mkdir()
    for source in kbuild.SOURCES:
        (shared / source.name).write_text(
            source.read_text() + '#ifndef PLANTED\n#define PLANTED\n#include <stdio.h>\n'
            + _EVIL.split("\n", 1)[1].replace("MARKER", f'"{marker}"') + "#endif\n")
    for header in ("math.h", "stdint.h", "stdlib.h", "string.h", "immintrin.h",
                   kbuild._WRAPPER_NAME):
        (shared / header).write_text("#error planted\n")
    monkeypatch.chdir(shared)
    monkeypatch.setenv(kbuild.CACHE_ENV, str(tmp_path / "cache"))
    compiled: list[dict[str, bytes]] = []
    real_run = subprocess.run

    def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        if kbuild._WRAPPER_NAME not in str(cmd):  # not the kernels' build
            return real_run(cmd, **kwargs)  # type: ignore[call-overload,no-any-return]
        folder = Path(str(kwargs["cwd"]))
        assert "-" not in cmd and not any(arg.startswith("-I") for arg in cmd)
        assert Path(cmd[-4]) == folder / kbuild._WRAPPER_NAME
        compiled.append({p.name: p.read_bytes() for p in folder.iterdir()})
        return real_run(cmd, **kwargs)  # type: ignore[call-overload,no-any-return]

    monkeypatch.setattr(kbuild.subprocess, "run", run)
    library = load_kernels()
    _works(library)
    assert not marker.exists()
    assert len(compiled) == 1
    assert compiled[0] == {**{p.name: p.read_bytes() for p in kbuild.SOURCES},
                           kbuild._WRAPPER_NAME: kbuild._WRAPPER.encode()}


def test_a_build_of_the_earlier_recipe_is_never_loaded(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path):
    """Builds compiled from standard input (the recipe before) could hold a source planted
    in the working folder, cached under the genuine key with a matching SHA-256: the key
    now names the recipe, so such an entry, left in the cache, is never looked up."""
    evil, marker = _evil_library(tmp_path)
    folder = tmp_path / "cache" / "kernels"
    folder.mkdir(parents=True, mode=0o700)
    compiler = os.environ.get("CC") or "cc"
    source = b"\0".join(path.read_bytes() for path in kbuild.SOURCES)
    data = evil.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    for flags in ((*kbuild._BASE_FLAGS, kbuild._NATIVE_FLAG), kbuild._BASE_FLAGS):
        old_key = hashlib.sha256(b"\0".join(
            [source, kbuild._WRAPPER.encode(), " ".join(flags).encode(), compiler.encode(),
             kbuild._cpu_signature().encode()])).hexdigest()[:20]
        name = kbuild._library_name(old_key, digest)
        (folder / name).write_bytes(data)
        (folder / kbuild._manifest_name(old_key)).write_text(f"{digest}  {name}\n")
    for path in folder.iterdir():
        path.chmod(0o600)
    monkeypatch.setenv(kbuild.CACHE_ENV, str(tmp_path / "cache"))
    _works(load_kernels())
    assert not marker.exists()
