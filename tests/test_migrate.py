"""Config files of earlier versions (imba/training/migrate.py): renamed and dropped keys, flat settings that became a
kind setting, and a kind section's keys its kind does not read, each migrated in one line; what no version read is
still refused."""

import pytest
import yaml

from data.balance import TemperatureBalance
from imba.training import migrate
from imba.training.config import ConfigError, as_data, load_config, save_config


def test_migration_moves_renamed_keys_and_drops_dropped_ones_in_one_line():
    lines = []
    saved = {"data": {"foo": 3, "resolution": 32}, "loss": {"old": True, "kind": "imba"}, "optim": {"a": 1, "b": 2}}
    migrated = migrate.migrate_config(saved, "run/config.yaml", renamed={"data.foo": "data.bar", "optim.a": "optim.b"},
                                      dropped={"loss.old": "no longer used", "loss.never": "absent"}, log=lines.append)
    assert migrated == {"data": {"bar": 3, "resolution": 32}, "loss": {"kind": "imba"}, "optim": {"b": 2}}
    assert saved["data"] == {"foo": 3, "resolution": 32}  # the caller's mapping is left as it was
    assert lines == ["config of run/config.yaml: data.foo renamed to data.bar; optim.a dropped (optim.b, its new "
                     "name, is set too); loss.old dropped (no longer used)"]
    lines.clear()
    assert migrate.migrate_config(migrated, "x", renamed={"data.foo": "data.bar"}, log=lines.append) == migrated
    assert lines == []  # nothing to migrate: nothing said


# data.balance and its flat settings as every config.yaml written before data.balance became a kind setting holds them
FLAT_BALANCE = {"balance_alpha": 0.7, "balance_cap": 0, "balance_every": 50, "balance_fraction": 0.25,
                "balance_groups": 3, "balance_max": 2.0, "balance_rate": 4.0}


@pytest.mark.parametrize("kind,nested,unread", [
    ("none", {"kind": "none"}, list(FLAT_BALANCE)),
    ("temperature", {"kind": "temperature", "by": "captions", "alpha": 0.7},
     [k for k in FLAT_BALANCE if k != "balance_alpha"]),
    ("imba", {"kind": "imba", "alpha": 0.7, "every": 50, "fraction": 0.25, "groups": 3, "max_factor": 2.0,
              "rate": 4.0}, ["balance_cap"]),
])
def test_flat_balance_settings_become_the_kind_setting_in_one_line(kind, nested, unread, tmp_path, capsys):
    old = tmp_path / "config.yaml"
    old.write_text(yaml.safe_dump({"data": {"resolution": 32, "balance": kind, **FLAT_BALANCE}}))
    cfg = load_config(["--config", str(old)])
    assert as_data(cfg.data.balance) == nested
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 1 and said[0].startswith(f"config of {old}: ")
    assert (f"dropped (not read by data.balance kind {kind})" in said[0]) == bool(unread)
    assert all(f"data.{key}" in said[0] for key in unread)
    # the config it writes is read back as it is, with nothing to say
    again = tmp_path / "again.yaml"
    save_config(cfg, again)
    assert load_config(["--config", str(again)]) == cfg and capsys.readouterr().out == ""


def test_flat_balance_overrides_are_read_as_the_kind_setting_they_became(capsys):
    cfg = load_config(["data.balance_alpha=0.25", "data.balance=temperature"])
    assert cfg.data.balance == TemperatureBalance(0.25)
    assert capsys.readouterr().out == ("config of the command line: data.balance_alpha became data.balance: "
                                       "{kind: temperature, alpha: 0.25}\n")
    with pytest.raises(ConfigError, match="'data.balance.every' \\(data.balance kind temperature reads by, alpha\\)"):
        load_config(["--config", "configs/mix.yaml", "data.balance_every=5"])  # its kind comes from the file



def test_an_old_complete_section_drops_the_keys_its_kind_does_not_read_and_keeps_an_unknown_one():
    lines = []
    old = {"loss": {"kind": "plain", "gamma": 0.8, "lam": 0.7, "distance": "mse", "reference": "target",
                    "normalize": "none", "estimator": "literal", "knob": 1},
           "objective": {"kind": "ddpm", "shift": 2.0, "beta_start": 0.001}}  # not every key: a user's own file
    migrated = migrate.migrate_config(old, "old.yaml", log=lines.append)
    assert migrated["loss"] == {"kind": "plain", "lam": 0.7, "knob": 1}  # knob: refused when the config is read
    assert migrated["objective"] == old["objective"]
    assert lines == ["config of old.yaml: loss.gamma, loss.distance, loss.reference, loss.normalize, loss.estimator "
                     "dropped (not read by loss kind plain)"]
    imba = migrate.migrate_config({"loss": {**old["loss"], "kind": "imba"}}, "x", log=lines.append)
    assert imba["loss"] == {**old["loss"], "kind": "imba"} and len(lines) == 1  # imba reads them all: nothing said
    unknown = migrate.migrate_config({"loss": {**old["loss"], "kind": "focal"}}, "x", log=lines.append)
    assert unknown["loss"]["kind"] == "focal" and len(lines) == 1  # the config's own check names the wrong kind
    with pytest.raises(ConfigError, match="'objective.shift' \\(objective kind ddpm reads"):
        load_config(["objective=ddpm", "objective.shift=2"])


def test_flat_keys_join_a_nested_setting_and_a_wrong_kind_is_left_to_the_config(capsys):
    lines = []
    both = {"data": {"balance": {"kind": "imba", "every": 5, "rate": 3.0}, "balance_rate": 2.0,
                     "balance_groups": 6}}
    migrated = migrate.migrate_config(both, "x", log=lines.append)
    assert migrated["data"]["balance"] == {"kind": "imba", "every": 5, "rate": 3.0, "groups": 6}  # its own rate read
    assert lines == ["config of x: data.balance_groups became data.balance: {kind: imba, every: 5, rate: 3.0, "
                     "groups: 6}"]
    wrong = migrate.migrate_config({"data": {"balance": "inverse", "balance_alpha": 1, "balance_cap": 3}}, "x",
                                   log=lines.append)
    assert wrong["data"]["balance"] == {"kind": "inverse", "alpha": 1, "cap": 3}  # nothing dropped for it
    with pytest.raises(ConfigError, match="'data.balance' must be one of none, temperature, spread, cap, imba"):
        load_config(["data.balance=inverse", "data.balance_alpha=1"])
    none = migrate.migrate_config({"data": {"balance": "none", "balance_alpha": 1, "balance_cap": 3}}, "y",
                                  log=lines.append)
    assert none["data"]["balance"] == {"kind": "none"}
    assert lines[-1] == "config of y: data.balance_alpha, data.balance_cap dropped (not read by data.balance kind none)"


def test_renames_reach_sections_the_file_lacks_and_each_table_is_read_whole(monkeypatch, capsys):
    lines = []
    moved = migrate.migrate_config({"data": {"foo": 1}}, "x", renamed={"data.gone": "data.x", "data.foo": "extra.bar"},
                                   dropped={}, log=lines.append)
    assert moved == {"data": {}, "extra": {"bar": 1}} and lines == ["config of x: data.foo renamed to extra.bar"]
    flat = {"data": {"balance_alpha": 1}}
    assert migrate.migrate_config(flat, "x", renamed={}, dropped={}, nested={}, log=lines.append) == flat
    monkeypatch.setenv("RANK", "1")  # every process reads the config; one of them says what changed
    migrate.migrate_config({"data": {"foo": 1}}, "x", renamed={"data.foo": "data.bar"})
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    migrate.migrate_config({"data": {"foo": 1}}, "x", renamed={"data.foo": "data.bar"})
    assert capsys.readouterr().out == "config of x: data.foo renamed to data.bar\n"
