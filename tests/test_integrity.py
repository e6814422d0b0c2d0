"""Checkpoint integrity at its edges: the manifest of a nested folder against hashlib's own digests (files larger
than one read chunk, empty files, excluded paths), each way a folder can differ from its manifest found and named,
sizes checked before any checksum, and the fallback to the newest checkpoint whose names and sizes match."""

import hashlib
import json
import os

import pytest

import imba.training.integrity as integrity
from imba.training.checkpoints import (
    CONFIG_FILE,
    EMA_STATE_FILE,
    LATEST,
    MANIFEST_FILE,
    CheckpointError,
    list_checkpoints,
    newest_intact,
    require_intact,
    resolve_resume,
    verify_checkpoint,
    write_manifest,
)
from imba.training.integrity import check_manifest, file_digest, folder_manifest


def _tree(folder):
    (folder / "sub" / "deeper").mkdir(parents=True)
    files = {"a.bin": b"alpha" * 1000, "empty": b"", "sub/b.txt": b"bravo", "sub/deeper/c": os.urandom(3000)}
    for rel, data in files.items():
        (folder / rel).write_bytes(data)
    return files


def test_manifest_lists_every_file_recursively_with_hashlibs_sha256(tmp_path):
    files = _tree(tmp_path)
    manifest = folder_manifest(tmp_path)
    assert manifest["algorithm"] == "sha256" and list(manifest["files"]) == sorted(files)
    for rel, data in files.items():
        assert manifest["files"][rel] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert list(folder_manifest(tmp_path, exclude=("sub/b.txt", "a.bin"))["files"]) == ["empty", "sub/deeper/c"]
    assert folder_manifest(tmp_path / "sub" / "deeper")["files"].keys() == {"c"}


def test_a_file_read_in_many_chunks_hashes_like_one_read(tmp_path, monkeypatch):
    monkeypatch.setattr(integrity, "_CHUNK", 7)  # 1000 bytes: 142 full reads and a short last one
    data = os.urandom(1000)
    (tmp_path / "f").write_bytes(data)
    assert file_digest(tmp_path / "f") == hashlib.sha256(data).hexdigest()
    (tmp_path / "g").write_bytes(data[:994])  # an exact multiple of the chunk
    assert file_digest(tmp_path / "g") == hashlib.sha256(data[:994]).hexdigest()


def _flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage,reason", [
    (lambda f: (f / "sub/b.txt").unlink(), "missing file sub/b.txt"),
    (lambda f: (f / "a.bin").write_bytes(b"alpha" * 999), "a.bin is 4995 bytes, the manifest says 5000"),
    (lambda f: (f / "empty").write_bytes(b"x"), "empty is 1 bytes, the manifest says 0"),
    (lambda f: _flip_last_byte(f / "sub/deeper/c"), "sub/deeper/c does not match its sha256"),
    (lambda f: (f / "sub").rename(f / "moved"), "missing file sub/"),
])
def test_each_difference_is_found_and_names_its_file(tmp_path, damage, reason):
    _tree(tmp_path)
    manifest = folder_manifest(tmp_path)
    assert check_manifest(tmp_path, manifest) is None
    damage(tmp_path)
    found = check_manifest(tmp_path, manifest)
    assert found is not None and found.startswith(reason)


def test_same_size_new_bytes_pass_without_checksums_and_unlisted_files_are_ignored(tmp_path):
    _tree(tmp_path)
    manifest = folder_manifest(tmp_path)
    (tmp_path / "a.bin").write_bytes(b"ALPHA" * 1000)
    assert check_manifest(tmp_path, manifest, checksums=False) is None
    assert "a.bin does not match" in check_manifest(tmp_path, manifest)
    (tmp_path / "a.bin").write_bytes(b"alpha" * 1000)
    (tmp_path / "derived.json").write_text("{}")  # added after the manifest: ignored
    assert check_manifest(tmp_path, manifest) is None


def test_sizes_are_all_checked_before_any_file_is_hashed(tmp_path, monkeypatch):
    _tree(tmp_path)
    manifest = folder_manifest(tmp_path)
    (tmp_path / "sub/deeper/c").write_bytes(b"short")  # the last file listed
    hashed = []
    monkeypatch.setattr(integrity, "file_digest", lambda path: hashed.append(path) or "0" * 64)
    assert check_manifest(tmp_path, manifest).startswith("sub/deeper/c is 5 bytes")
    assert hashed == []


@pytest.mark.parametrize("manifest", [{}, {"algorithm": "md5", "files": {"a": {"size": 1, "md5": "x"}}},
                                      {"algorithm": "sha256", "files": {}}, {"algorithm": "sha256", "files": []},
                                      {"algorithm": "sha256"}])
def test_an_unreadable_or_empty_manifest_is_a_reason_not_a_pass(tmp_path, manifest):
    _tree(tmp_path)
    assert check_manifest(tmp_path, manifest).startswith("unreadable manifest")


# ---------------------------------------------------------------------------------------------------------------
# checkpoint folders
# ---------------------------------------------------------------------------------------------------------------


def _checkpoint(root, step, manifest=True, payload=b"weights"):
    folder = root / f"step_{step:07d}"
    folder.mkdir(parents=True)
    (folder / CONFIG_FILE).write_text("train: {}\n")
    (folder / EMA_STATE_FILE).write_bytes(b"ema")
    (folder / "model.safetensors").write_bytes(payload)
    if manifest:
        write_manifest(folder)
    return folder


def test_verify_checkpoint_reasons(tmp_path):
    good = _checkpoint(tmp_path, 1)
    assert verify_checkpoint(good) is None and verify_checkpoint(good, checksums=False) is None
    assert json.loads((good / MANIFEST_FILE).read_text())["files"].keys() == {CONFIG_FILE, EMA_STATE_FILE,
                                                                              "model.safetensors"}
    assert verify_checkpoint(tmp_path / "nothing") == "not a folder"
    assert verify_checkpoint(_checkpoint(tmp_path, 2, manifest=False)).startswith(f"no {MANIFEST_FILE}")
    broken = _checkpoint(tmp_path, 3)
    (broken / MANIFEST_FILE).write_text("{not json")
    assert verify_checkpoint(broken) == f"{MANIFEST_FILE} is unreadable"
    changed = _checkpoint(tmp_path, 4)
    (changed / "model.safetensors").write_bytes(b"WEIGHTS")
    assert verify_checkpoint(changed, checksums=False) is None
    assert "does not match its sha256" in verify_checkpoint(changed)


def test_newest_intact_passes_over_newer_damaged_and_unverifiable_ones(tmp_path):
    assert newest_intact(tmp_path / "none") is None and newest_intact(tmp_path) is None
    _checkpoint(tmp_path, 9)  # step 9 < step 10 by number, not by name length
    only = _checkpoint(tmp_path, 10)
    assert newest_intact(tmp_path) == only
    truncated = _checkpoint(tmp_path, 11)
    (truncated / "model.safetensors").write_bytes(b"w")
    _checkpoint(tmp_path, 12, manifest=False)
    (tmp_path / ".tmp_step_0000013").mkdir()
    (tmp_path / "step_0000014").write_text("a file, not a folder")
    assert newest_intact(tmp_path) == only
    assert [p.name for p in list_checkpoints(tmp_path)] == [f"step_{s:07d}" for s in (9, 10, 11, 12)]
    (tmp_path / "unpadded").mkdir()
    os.rename(tmp_path / "step_0000009", tmp_path / "step_9")
    assert [p.name for p in list_checkpoints(tmp_path)][:2] == ["step_9", "step_0000010"]


def test_resume_latest_tries_the_pointer_then_newest_first_and_logs_each_one_passed_over(tmp_path):
    log = []
    assert resolve_resume("none", tmp_path) is None and resolve_resume(None, tmp_path) is None
    assert resolve_resume(LATEST, tmp_path, log=log.append) is None  # nothing saved yet: a fresh start
    first, second, third = (_checkpoint(tmp_path, s) for s in (1, 2, 3))
    assert resolve_resume(LATEST, tmp_path, log=log.append) == third  # no pointer: the newest
    (tmp_path / LATEST).write_text(second.name + "\n")
    assert resolve_resume(LATEST, tmp_path, log=log.append) == second and log == []
    (second / "model.safetensors").write_bytes(b"WEIGHTS")  # same size: only the checksum finds it
    assert resolve_resume(LATEST, tmp_path, log=log.append) == third
    assert len(log) == 1 and str(second) in log[0] and "sha256" in log[0]
    assert resolve_resume(LATEST, tmp_path, checksums=False, log=log.append) == second
    (tmp_path / LATEST).write_text("step_0000099\n")  # a pointer to nothing: the newest
    assert resolve_resume(LATEST, tmp_path, log=log.append) == third
    for folder in (first, third):
        (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no intact checkpoint") as err:
        resolve_resume(LATEST, tmp_path, log=log.append)
    assert "\n" not in str(err.value) and "3 found" in str(err.value)


def test_an_explicit_checkpoint_must_verify_and_one_without_manifest_is_used_with_a_warning(tmp_path):
    log = []
    good = _checkpoint(tmp_path, 1)
    assert resolve_resume(str(good), tmp_path, log=log.append) == good and log == []
    old = _checkpoint(tmp_path, 2, manifest=False)
    assert require_intact(old, log=log.append) == old and "unverified" in log[0]
    (old / EMA_STATE_FILE).unlink()
    with pytest.raises(CheckpointError, match="not a training checkpoint"):
        require_intact(old)
    (good / "model.safetensors").write_bytes(b"WEIGHTS")
    with pytest.raises(CheckpointError, match="is damaged"):
        resolve_resume(str(good), tmp_path)
    assert require_intact(good, checksums=False) == good
    with pytest.raises(FileNotFoundError):
        resolve_resume(str(tmp_path / "step_0000077"), tmp_path)


def test_fsync_dir_opens_a_directory_and_refuses_a_file(tmp_path):
    from imba.training.integrity import fsync_dir, fsync_tree

    _tree(tmp_path)
    fsync_dir(tmp_path)
    fsync_tree(tmp_path)
    with pytest.raises(NotADirectoryError):  # O_DIRECTORY: a path that is not a folder is an error, not a no-op
        fsync_dir(tmp_path / "a.bin")


def test_a_manifest_written_again_never_lists_itself(tmp_path):
    folder = _checkpoint(tmp_path, 1)
    write_manifest(folder)  # e.g. a save retried into the same folder
    assert MANIFEST_FILE not in json.loads((folder / MANIFEST_FILE).read_text())["files"]
    assert verify_checkpoint(folder) is None


def test_newest_intact_checks_names_and_sizes_only(tmp_path):
    _checkpoint(tmp_path, 1)
    newest = _checkpoint(tmp_path, 2)
    (newest / "model.safetensors").write_bytes(b"WEIGHTS")  # same size: only a checksum would tell
    assert newest_intact(tmp_path) == newest


def test_an_undecodable_pointer_falls_back_to_the_newest(tmp_path):
    _checkpoint(tmp_path, 1)
    newest = _checkpoint(tmp_path, 2)
    (tmp_path / LATEST).write_bytes(b"step_\xff\xfe\n")
    assert resolve_resume(LATEST, tmp_path, log=lambda line: None) == newest


def test_an_explicit_path_passes_checksums_and_log_through(tmp_path):
    good = _checkpoint(tmp_path, 1)
    (good / "model.safetensors").write_bytes(b"WEIGHTS")
    with pytest.raises(CheckpointError, match="does not match its sha256"):
        require_intact(good)  # checksums by default
    assert resolve_resume(str(good), tmp_path, checksums=False) == good
    old = _checkpoint(tmp_path, 2, manifest=False)
    log = []
    assert resolve_resume(str(old), tmp_path, log=log.append) == old and "unverified" in log[0]
    with pytest.raises(FileNotFoundError, match=r"checkpoint '.*step_0000009' not found; pass --resume latest"):
        resolve_resume(str(tmp_path / "step_0000009"), tmp_path)
    with pytest.raises(FileNotFoundError, match=r"checkpoint '.*step_0000009' not found$"):
        require_intact(tmp_path / "step_0000009")


def test_the_unverified_hint_is_given_only_for_a_newest_without_manifest(tmp_path):
    damaged = _checkpoint(tmp_path, 1)
    (damaged / "model.safetensors").unlink()
    with pytest.raises(CheckpointError) as err:
        resolve_resume(LATEST, tmp_path, log=lambda line: None)
    assert str(err.value).endswith("missing file model.safetensors)")  # no hint: naming it would not help
    _checkpoint(tmp_path, 2, manifest=False)
    with pytest.raises(CheckpointError) as err:
        resolve_resume(LATEST, tmp_path, log=lambda line: None)
    assert str(err.value).endswith(f"to resume it unverified, name it: train.resume={tmp_path / 'step_0000002'}")
