"""The caches hold data, not code, in a folder only the user can write; every entry is checked where it is read.

Each case of the attack the security issue describes is here: a planted pickle, a folder other users can
write or own, garbled, truncated and swapped entries of the graph, facts and plan-row caches. The oracle of
every "recaptured" case is the same run with the cache off (``--no-cache`` / an empty cache folder).
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import stat
from pathlib import Path

import pytest

from fxworkload import store
from fxworkload.errors import UserError
from fxworkload.pipeline import extract
from fxworkload.plan import plan

from .conftest import tiny_config
from .test_cli import in_process

PACKAGE = Path(__file__).resolve().parents[1] / "fxworkload"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("FXWORKLOAD_CACHE_DIR", str(folder))
    return folder


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2")
    tiny_config("gpt2").save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def fresh_totals(gpt2):
    """The oracle: the step captured with no cache at all."""
    return {seq: extract(gpt2, seq=seq, device="h100-sxm", use_cache=False).totals for seq in (8, 16)}


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):  # what an attacker's pickle does: call any function on load
        return (os.system, (f"touch {self.marker}",))


def test_no_module_of_the_package_can_load_code_from_disk():
    """No pickle (or marshal, shelve, dill, joblib, torch.load, numpy's allow_pickle) anywhere in the package."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
            module = node.module if isinstance(node, ast.ImportFrom) else ""
            if {"pickle", "cPickle", "marshal", "shelve", "dill", "joblib", "cloudpickle"} & {*names, module}:
                found.append(f"{path.name}: imports {names or module}")
            if isinstance(node, ast.Attribute) and node.attr == "load" and isinstance(node.value, ast.Name) \
                    and node.value.id in ("torch", "np", "numpy"):
                found.append(f"{path.name}: {node.value.id}.load")
            if isinstance(node, ast.keyword) and node.arg == "allow_pickle":
                found.append(f"{path.name}: allow_pickle")
    assert found == []


def test_a_planted_pickle_runs_nothing_and_the_step_is_captured_again(gpt2, cache, tmp_path, fresh_totals):
    extract(gpt2, seq=8, device="h100-sxm")
    (entry,) = (cache / "graphs").glob("*.json")
    marker = tmp_path / "owned"
    payload = pickle.dumps(_RunsCode(marker))
    entry.write_bytes(payload)
    entry.with_suffix(".pkl").write_bytes(payload)  # where the old releases looked
    again = extract(gpt2, seq=8, device="h100-sxm")
    assert not marker.exists()
    assert again.totals == fresh_totals[8]
    assert json.loads(entry.read_text())["kind"] == "captured-step"  # rewritten by the recapture


def test_a_run_read_from_the_cache_writes_the_same_bytes_as_the_run_that_captured(gpt2, cache, tmp_path):
    """make run twice: the second reads the step from the cache; every file it writes is byte-identical (the
    attention facts' keys were once read back sorted)."""
    args = ("extract", gpt2, "--seq", 16, "--device", "h100-sxm", "--format", "tables,simai,chrome-trace")
    assert in_process(*args, "--out", tmp_path / "captured").returncode == 0
    assert in_process(*args, "--out", tmp_path / "cached").returncode == 0
    names = sorted(p.name for p in (tmp_path / "captured").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "cached").iterdir())
    assert '"attention": {' in (tmp_path / "captured" / "workload.json").read_text()  # facts to order
    for name in names:
        assert (tmp_path / "captured" / name).read_bytes() == (tmp_path / "cached" / name).read_bytes(), name


def _one_line(run, *says):
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert all(s in lines[0] for s in says) and "Traceback" not in run.stderr, run.stderr


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o707])
def test_a_cache_folder_others_can_write_is_refused_with_the_fix(gpt2, cache, tmp_path, monkeypatch, mode):
    monkeypatch.setattr(store, "_private_group", lambda gid: False)  # a group shared with other users
    cache.mkdir()
    os.chmod(cache, mode)  # sticky or not: in a folder others can write, they can plant an entry first
    run = in_process("extract", gpt2, "--seq", 8, "--device", "h100-sxm", "--out", tmp_path / "out")
    _one_line(run, f"cache folder {cache}", "chmod go-w", "FXWORKLOAD_CACHE_DIR")
    assert not (tmp_path / "out").exists() and list(cache.iterdir()) == []


def test_a_subfolder_others_can_write_is_refused(gpt2, cache, tmp_path):
    (cache / "graphs").mkdir(parents=True)
    os.chmod(cache / "graphs", 0o777)
    run = in_process("extract", gpt2, "--seq", 8, "--device", "h100-sxm", "--out", tmp_path / "out")
    _one_line(run, f"cache folder {cache / 'graphs'} is writable by every user")


def test_a_group_writable_folder_is_allowed_only_for_the_users_private_group(cache, monkeypatch):
    cache.mkdir()
    os.chmod(cache, 0o770)
    monkeypatch.setattr(store, "_private_group", lambda gid: True)
    store.check_folder(cache)
    monkeypatch.setattr(store, "_private_group", lambda gid: False)
    with pytest.raises(UserError, match="writable by its group"):
        store.check_folder(cache)


def test_a_folder_above_may_be_world_writable_only_with_the_sticky_bit(tmp_path, monkeypatch):
    common = tmp_path / "common"
    (common / "mine").mkdir(parents=True)
    monkeypatch.setenv("FXWORKLOAD_CACHE_DIR", str(common / "mine"))
    os.chmod(common, 0o1777)  # like /tmp: no one else can rename or replace 'mine'
    store.check_folder(common / "mine")
    os.chmod(common, 0o777)  # anyone could move 'mine' away and put their own folder there
    with pytest.raises(UserError, match=f"cache folder {common} is writable by every user"):
        store.check_folder(common / "mine")


def test_a_cache_folder_not_made_yet_under_a_sticky_folder_is_made_the_users_alone(gpt2, tmp_path, monkeypatch):
    """FXWORKLOAD_CACHE_DIR=/tmp/<new>: /tmp is world-writable but sticky, so the new folder is safe to make."""
    common = tmp_path / "common"
    common.mkdir()
    os.chmod(common, 0o1777)
    monkeypatch.setenv("FXWORKLOAD_CACHE_DIR", str(common / "new" / "cache"))
    extract(gpt2, seq=8, device="h100-sxm")
    assert stat.S_IMODE((common / "new" / "cache").stat().st_mode) == 0o700
    assert len(list((common / "new" / "cache" / "graphs").glob("*.json"))) == 1


def test_a_cache_folder_another_user_owns_is_refused(gpt2, cache, tmp_path, monkeypatch):
    cache.mkdir()
    if os.geteuid() == 0:  # root: give the folder to 'nobody'
        os.chown(cache, 65534, -1)
    else:  # anyone else: this process plays another user (the folder's owner is neither it nor root)
        me = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: me + 1)
    run = in_process("extract", gpt2, "--seq", 8, "--device", "h100-sxm", "--out", tmp_path / "out")
    _one_line(run, f"cache folder {cache} belongs to another user", "FXWORKLOAD_CACHE_DIR")


def test_entries_are_the_users_alone_and_no_temporary_file_is_left(gpt2, cache):
    extract(gpt2, seq=8, device="h100-sxm")
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    (entry,) = (cache / "graphs").iterdir()  # no '.tmp' beside it
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600 and entry.suffix == ".json"


def test_a_symlink_in_place_of_an_entry_is_not_followed(gpt2, cache, tmp_path, fresh_totals):
    extract(gpt2, seq=8, device="h100-sxm")
    (entry,) = (cache / "graphs").glob("*.json")
    target = tmp_path / "elsewhere.json"
    target.write_text(entry.read_text())
    entry.unlink()
    entry.symlink_to(target)
    again = extract(gpt2, seq=8, device="h100-sxm")
    assert again.totals == fresh_totals[8]
    assert not entry.is_symlink() and target.read_text() == entry.read_text()  # replaced, not written through


def _garbled(entry: Path) -> dict[str, bytes]:
    good = entry.read_bytes()
    document = json.loads(good)
    wrong_type = json.loads(good)
    wrong_type["data"]["ops"][0]["flops"] = True
    missing = json.loads(good)
    del missing["data"]["facts"]["layers"]
    dangling = json.loads(good)
    dangling["data"]["rows"][-1]["node"]["forward"] = 10 ** 9
    return {
        "empty": b"", "truncated": good[: len(good) // 2], "42": b"42", "list": b"[]", "object": b"{}",
        "null": b"null", "binary": b"\x80\x04\x95garbage\xff",
        "nan": good.replace(b'"flops":', b'"flops":NaN,"x":', 1),
        "other kind": json.dumps(document | {"kind": "plan-rows"}).encode(),
        "old schema": json.dumps(document | {"schema": 0}).encode(),
        "a flag for a count": json.dumps(wrong_type).encode(),
        "a field missing": json.dumps(missing).encode(),
        "an op that is not there": json.dumps(dangling).encode(),
    }


def test_garbled_graph_entries_are_captured_again_and_said_under_verbose(gpt2, cache, tmp_path, fresh_totals):
    extract(gpt2, seq=8, device="h100-sxm")
    (entry,) = (cache / "graphs").glob("*.json")
    for case, content in _garbled(entry).items():
        entry.write_bytes(content)
        run = in_process("extract", gpt2, "--seq", 8, "--device", "h100-sxm", "--verbose", "--out", tmp_path / case)
        assert run.returncode == 0, (case, run.stderr)
        assert "not used" in run.stderr and str(entry) in run.stderr, (case, run.stderr)
        written = json.loads((tmp_path / case / "workload.json").read_text())["totals"]
        assert {k: written[k] for k in ("forward_flops", "input_grad_flops", "weight_grad_flops")} == \
            {k: fresh_totals[8][k] for k in ("forward_flops", "input_grad_flops", "weight_grad_flops")}, case


def test_an_entry_copied_over_another_key_is_not_used(gpt2, cache, fresh_totals):
    """The issue's case: a seq-8 capture copied over the seq-16 key reported the seq-8 FLOPs."""
    extract(gpt2, seq=8, device="h100-sxm")
    (short,) = (cache / "graphs").glob("*.json")
    extract(gpt2, seq=16, device="h100-sxm")
    (long,) = set((cache / "graphs").glob("*.json")) - {short}
    long.write_bytes(short.read_bytes())
    assert extract(gpt2, seq=16, device="h100-sxm").totals == fresh_totals[16]


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama4")
    tiny_config("llama", num_hidden_layers=4).save_pretrained(folder)
    return str(folder)


def _plan(model, device="h100-sxm"):
    return plan(model, gpus=2, global_batch=4, seq=16, device=device, workers=1)


@pytest.fixture(scope="module")
def fresh_plan(four_layers, tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setenv("FXWORKLOAD_CACHE_DIR", str(tmp_path_factory.mktemp("fresh-cache")))
    try:
        return _plan(four_layers, "h100-sxm,b200")
    finally:
        patch.undo()


GARBLED_ROWS = ["[]", "{}", "null", "[NaN]", "42", "", "[{}]", "[1, 2]", "not json"]


def test_garbled_plan_rows_are_not_used(four_layers, cache, monkeypatch):
    """Each rows file replaced by a garbled text, as the whole file or as the data of an entry of the right kind
    and key, or by a row whose figure is not a number: not used (the shape is evaluated again). The calls are
    those a warm plan makes, recorded."""
    import fxworkload.plan as planning

    _plan(four_layers, "h100-sxm,b200")
    calls = []
    real = planning._cached_rows
    monkeypatch.setattr(planning, "_cached_rows", lambda entry, task: calls.append((entry, task)) or real(entry, task))
    _plan(four_layers, "h100-sxm,b200")
    assert calls and all(real(entry, task) is not None for entry, task in calls)  # the good entries are used
    for (path, key), task in calls:
        entry = json.loads(path.read_text())
        for content in GARBLED_ROWS:
            path.write_text(content)
            assert real((path, key), task) is None, content
            if content and content != "not json":
                path.write_text(json.dumps({k: v for k, v in entry.items() if k != "data"})[:-1] + f', "data": {content}}}')
                assert real((path, key), task) is None, content
        for figure, value in (("step_ms", "1"), ("mfu", True), ("peak_bytes", None), ("tp", 3), ("fits", 1)):
            row = entry["data"][0] | {figure: value}
            path.write_text(json.dumps(entry | {"data": [row, *entry["data"][1:]]}))
            assert real((path, key), task) is None, figure


def test_plan_rows_swapped_between_devices_are_not_used(four_layers, cache, fresh_plan):
    """The issue's case: rows files swapped between keys gave an h100-sxm plan that ranked b200 rows."""
    _plan(four_layers, "h100-sxm,b200")
    entries = {p: json.loads(p.read_text()) for p in (cache / "plans").glob("*.json")}
    by_device: dict[str, list[Path]] = {}
    for path, entry in entries.items():
        by_device.setdefault(entry["data"][0]["device"], []).append(path)
    h100, b200 = by_device["h100-sxm"][0], by_device["b200"][0]
    h100.write_text(json.dumps(entries[b200]))  # swapped whole: its key says so
    b200.write_text(json.dumps(entries[b200] | {"key": entries[h100]["key"]}))  # re-keyed: its rows say so
    b200.rename(h100.with_name("x.json"))
    h100.with_name("x.json").rename(b200)
    again = _plan(four_layers, "h100-sxm,b200")
    assert again["ranked"] == fresh_plan["ranked"]
    only_h100 = _plan(four_layers)
    assert {r["device"] for r in only_h100["ranked"]} == {"h100-sxm"}


def test_garbled_model_facts_are_built_again(four_layers, cache, fresh_plan):
    import fxworkload.plan as planning

    _plan(four_layers)
    (facts,) = (cache / "facts").glob("*.json")
    entry = json.loads(facts.read_text())
    assert planning._cached_facts(four_layers, "bf16") is not None
    for content in ("42", "{}", "not json", json.dumps(entry | {"data": 42}),
                    json.dumps(entry | {"data": entry["data"] | {"layers": "four"}}),
                    json.dumps(entry | {"data": entry["data"] | {"layers": True}}),
                    json.dumps(entry | {"data": {k: v for k, v in entry["data"].items() if k != "heads"}})):
        facts.write_text(content)
        assert planning._cached_facts(four_layers, "bf16") is None, content
    facts.write_text("42")  # and a whole plan with it: the model is built again, the plan as with no cache
    assert _plan(four_layers, "h100-sxm,b200")["ranked"] == fresh_plan["ranked"]
    assert json.loads(facts.read_text())["kind"] == "model-facts"  # written again
