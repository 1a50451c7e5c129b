"""A user without a home folder (no ``HOME``, a user id without a passwd entry: ``docker run
--user 54321``, some batch systems): the optional caches are skipped, and a ``~`` path is one
line, never Python's "Could not determine home directory." traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nanolab.errors import NanolabError
from nanolab.estimator import facts_cache
from nanolab.home import expand_user, expanded_text, home_folder
from nanolab.run import keys

REPO = Path(__file__).resolve().parents[1]
#: A user id this machine has no passwd entry for, mapped in a user namespace (no root needed).
NO_PASSWD_UID = "54321"


@pytest.fixture
def homeless(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as such a user sees it: no HOME, and the passwd look-up failing."""
    import pwd

    for name in ("HOME", "XDG_CACHE_HOME", "NANOLAB_ESTIMATOR_CACHE"):
        monkeypatch.delenv(name, raising=False)

    def no_entry(uid: int) -> pwd.struct_passwd:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_entry)


def test_without_a_home_the_caches_are_off_and_a_tilde_path_is_one_line(homeless: None) -> None:
    assert home_folder() is None
    assert facts_cache.cache_dir() is None
    assert keys._cache_file("fit") is None and keys.known_keys("fit") is None
    keys.remember_keys("fit", ["trainer.max_steps"])  # nowhere to write: skipped, no error
    with pytest.raises(NanolabError, match=r"~/data starts with '~'.*HOME is unset.*full path"):
        expand_user("~/data")
    with pytest.raises(NanolabError, match=r"~/corpus/\*\.txt starts with '~'"):
        expanded_text("~/corpus/*.txt")
    assert expand_user("~/data", keep_unknown=True) == Path("~/data")  # a check that only looks
    assert expand_user("/abs/data") == Path("/abs/data")
    assert expanded_text("data/*.txt") == "data/*.txt"


def test_an_unknown_user_in_a_tilde_path_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", "/home/someone")
    assert expand_user("~/data") == Path("/home/someone/data")
    with pytest.raises(NanolabError, match=r"no user 'nosuchuser_nanolab' here"):
        expand_user("~nosuchuser_nanolab/data")


def _user_namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "-U", f"--map-user={NO_PASSWD_UID}", f"--map-group={NO_PASSWD_UID}"]
    return subprocess.run([*probe, "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _user_namespaces_work(), reason="no unprivileged user namespaces here")
def test_estimate_runs_as_a_user_without_home_or_passwd_entry(tmp_path: Path) -> None:
    """The real condition: a user namespace maps this process to a user id without a passwd
    entry, and HOME is unset."""
    import pwd

    with pytest.raises(KeyError):
        pwd.getpwuid(int(NO_PASSWD_UID))
    drop = ("HOME", "XDG_CACHE_HOME", "NANOLAB_ESTIMATOR_CACHE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), MPLCONFIGDIR=str(tmp_path / "mpl"))
    unshare = ["unshare", "-U", f"--map-user={NO_PASSWD_UID}", f"--map-group={NO_PASSWD_UID}"]
    config = REPO / "configs" / "quickstart.yaml"
    proc = subprocess.run(
        [*unshare, sys.executable, "-m", "nanolab", "estimate", "--config", str(config),
         "--vocab-size", "65"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "home directory" not in proc.stderr
    assert "peak" in proc.stdout or "memory" in proc.stdout.lower()


def test_estimate_reads_the_vocabulary_of_a_tilde_dataset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``data.dataset_dir: ~/data`` is the folder fit reads: estimate found no meta.json there
    (it looked under a literal ``./~``) and said the data was not prepared yet."""
    from nanolab.estimator.setup import resolve_vocab

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.json").write_text('{"vocab_size": 65}')
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path / "data")
    assert resolve_vocab({}, {"dataset_dir": "~/data"}) == 65


def test_a_tilde_setting_without_a_home_names_the_setting(homeless: None) -> None:
    from nanolab.estimator.setup import resolve_vocab

    with pytest.raises(NanolabError, match=r"^data.dataset_dir: ~/data starts with '~'"):
        resolve_vocab({}, {"dataset_dir": "~/data"})
