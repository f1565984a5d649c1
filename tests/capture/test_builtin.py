"""Model arguments: HuggingFace ids resolved from the local cache only (never the network), the
output name of a cache snapshot, and --name."""

from __future__ import annotations

import json

import pytest

from fxworkload.capture.builtin import locate
from fxworkload.cli import main
from fxworkload.errors import UserError

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tiny_dirs, tmp_path, monkeypatch):
    """A HuggingFace cache laid out as huggingface_hub writes it, holding one model's config."""
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-gpt"
    (repo / "snapshots" / COMMIT).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "snapshots" / COMMIT / "config.json").write_text((tiny_dirs["gpt2"] / "config.json").read_text())
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return repo / "snapshots" / COMMIT


def test_a_cached_hub_id_resolves_to_its_snapshot(hub_cache):
    name, config, folder = locate("acme/tiny-gpt")
    assert (name, config, folder) == ("tiny-gpt", hub_cache / "config.json", hub_cache)


def test_a_snapshot_folder_is_named_after_the_model_not_the_commit(hub_cache):
    assert locate(str(hub_cache))[0] == "tiny-gpt"


def test_an_uncached_hub_id_says_so_and_never_downloads(hub_cache):
    with pytest.raises(UserError, match=r"'acme/absent' is not in the local HuggingFace cache .*never downloads"):
        locate("acme/absent")


def test_extract_a_hub_id_into_outputs_named_after_it_or_after_name(hub_cache, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["extract", "acme/tiny-gpt", "--seq", "16"]) == 0
    assert json.loads((tmp_path / "outputs" / "tiny-gpt" / "workload.json").read_text())["settings"]["model"] == "tiny-gpt"
    assert main(["extract", "acme/tiny-gpt", "--seq", "16", "--name", "run-1"]) == 0
    assert json.loads((tmp_path / "outputs" / "run-1" / "workload.json").read_text())["settings"]["model"] == "run-1"
    capsys.readouterr()
    assert main(["extract", "acme/tiny-gpt", "--name", "../escape"]) == 2
    assert "--name '../escape' is not a name" in capsys.readouterr().err
