"""The CI scripts' own logic on saved outputs: ``make test``'s summary (ci/make_test.py), the
hosts' suites comparison (ci/host_suites.py) and the install check's pip-list comparison
(ci/install_keeps_torch.py).  Nothing here runs a suite or pip."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support import repo_scripts
from support.repo_scripts import ROOT

host_suites = repo_scripts.load("ci/host_suites.py")
install_keeps_torch = repo_scripts.load("ci/install_keeps_torch.py")
make_test = repo_scripts.load("ci/make_test.py")

SUITE_OUTPUT = """\
........s.....F
=================================== FAILURES ===================================
SKIPPED [2] tests/ops/test_x.py:10: the Triton kernels on CPU need TRITON_INTERPRET=1
SKIPPED [1] tests/gpu/conftest.py:5: needs a CUDA device
FAILED tests/ops/test_y.py::test_z - AssertionError
1 failed, 1203 passed, 3 skipped, 1 deselected, 14 warnings in 812.34s (0:13:32)""".splitlines()


def test_skips_are_grouped_by_reason_with_their_counts_and_files():
    lines = ["SKIPPED [8] tests/gpu/a.py:121: needs a CUDA device", "SKIPPED [4] tests/gpu/b.py:13: needs a CUDA device",
             "SKIPPED [1] tests/gpu/a.py:158: needs a CUDA device", "SKIPPED [2] tests/x.py:1: PyLate is not installed",
             "FAILED tests/y.py::z - SKIPPED [1] nothing"]
    assert make_test.skips_by_reason(lines) == {"needs a CUDA device": (13, ["tests/gpu/a.py", "tests/gpu/b.py"]),
                                                "PyLate is not installed": (2, ["tests/x.py"])}


def _outcome(kind, lines, rc=0, label="part"):
    return make_test.Outcome(make_test.Part(label, ["true"], kind), rc, 12.0, lines)


def test_pytest_totals_are_read_from_the_closing_line():
    assert make_test.pytest_counts(SUITE_OUTPUT) == {"failed": 1, "passed": 1203, "skipped": 3, "deselected": 1,
                                                    "warnings": 14}
    assert make_test.pytest_counts(["==== 2 passed, 1 error in 0.50s ===="]) == {"passed": 2, "errors": 1}
    assert make_test.pytest_counts(["no tests ran in 0.01s"]) == {}


def test_a_pytest_part_passes_only_with_exit_0_and_tests_that_passed():
    assert make_test.passed(_outcome("pytest", ["7 passed, 2 skipped in 3.00s"]))
    assert not make_test.passed(_outcome("pytest", ["no tests ran in 0.01s"], rc=5))
    assert make_test.detail(_outcome("pytest", ["no tests ran in 0.01s"], rc=5)) == [
        "pytest collected no tests (exit code 5)"]
    assert not make_test.passed(_outcome("pytest", ["2 skipped in 1.00s"]))
    assert not make_test.passed(_outcome("pytest", SUITE_OUTPUT, rc=1))
    assert make_test.detail(_outcome("pytest", SUITE_OUTPUT, rc=1)) == [
        "1203 passed, 1 failed, 3 skipped, 1 deselected"]


def test_the_summary_ends_with_the_skips_then_one_line_per_part_then_the_verdict():
    hosts = ["  pylate  zero-code  411 of 412 tests as unpatched   60.0 s",
             "host suites: pylate: 411 tests equal to unpatched in every mode, 1 deliberate difference (listed), "
             "0 unexpected",
             "host suites:   deliberate: tests.test_a::test_b (zero-code, explicit)",
             "host suites: 0 unexpected difference(s) in 1 host(s), 900 s (...)"]
    outcomes = [_outcome("pytest", SUITE_OUTPUT[:4] + ["1203 passed, 3 skipped in 812.34s"], label="suite"),
                _outcome("metal", ["case ... ok", "24/24 cases passed"], label="metal"),
                _outcome("hosts", hosts, label="hosts"),
                _outcome("install", ["install check: torch and every other package untouched"], label="install")]
    lines = make_test.summary(outcomes, 1000.0)
    text = "\n".join(lines)
    assert "rc=" not in text
    skips = lines.index("      2  the Triton kernels on CPU need TRITON_INTERPRET=1  (tests/ops/test_x.py)")
    first_part = next(i for i, line in enumerate(lines) if line.startswith("1. suite"))
    assert lines[skips - 1] == "skipped in suite, by reason (tests, reason, files):"
    assert skips < first_part
    assert lines[first_part].startswith("1. suite") and "passed: 1203 passed, 3 skipped  [12 s]" in lines[first_part]
    assert "2. metal" in text and "passed: 24/24 cases passed against the float64 reference" in text
    assert "411 tests equal to unpatched in every mode, 1 deliberate difference (listed), 0 unexpected" in text
    assert "deliberate: tests.test_a::test_b (zero-code, explicit)" in text
    assert "5." not in text and "4. install" in text
    assert lines[-1] == "make test: all 4 parts passed in 1000 s"
    failing = make_test.summary([outcomes[0], _outcome("metal", ["3/24 cases passed"], rc=1, label="metal")], 5.0)
    assert "FAILED (exit code 1): 3/24 cases passed" in "\n".join(failing)
    assert failing[-1] == "make test: FAILED: metal in 5 s"


def test_a_part_streams_its_output_and_keeps_it(capfd):
    outcome = make_test.run(make_test.Part("echo", [sys.executable, "-c", "print('x'); print('3 passed in 0.1s')"],
                                           "pytest"))
    assert outcome.returncode == 0 and outcome.lines == ["x", "3 passed in 0.1s"]
    assert "3 passed" in capfd.readouterr().out and make_test.passed(outcome)


# ------------------------------------------------------------------ ci/host_suites.py
def _runs():
    base = {"t::a": "passed", "t::b": "failed", "t::c": "skipped", "t::listed": "passed"}
    return {
        "unpatched": base,
        "zero-code": {**base, "t::listed": "failed"},
        "explicit": {**base, "t::listed": "failed"},
        "disabled": dict(base),
    }


def test_host_suites_counts_equal_deliberate_and_unexpected():
    listed = {("pylate", "t::listed"): "deliberate", ("pylate", "t::gone"): "fixed since"}
    result = host_suites.compare("pylate", _runs(), listed)
    # t::b fails in every mode alike (a host test that cannot pass here): equal, not a problem
    assert result["tests"] == 4 and result["equal"] == 3
    assert result["deliberate"] == {"t::listed": ["zero-code", "explicit"]}
    assert result["problems"] == [] and result["stale"] == ["pylate t::gone: listed but no longer differs"]
    lines = host_suites.summary_lines({"pylate": result}, 61.0)
    assert lines[0] == ("host suites: pylate: 3 tests equal to unpatched in every mode, 1 deliberate difference "
                        "(listed), 0 unexpected")
    assert lines[-1].startswith("host suites: 0 unexpected difference(s) in 1 host(s), 61 s")


def test_host_suites_flags_an_unlisted_difference_and_any_under_the_kill_switch():
    runs = _runs()
    runs["explicit"]["t::a"] = "failed"
    runs["disabled"]["t::listed"] = "failed"     # listed, but LIK_DISABLE=1 must change nothing
    result = host_suites.compare("pylate", runs, {("pylate", "t::listed"): "deliberate"})
    assert result["problems"] == ["pylate [explicit] t::a: passed unpatched, failed explicit",
                                  "pylate [disabled] t::listed: passed unpatched, failed disabled"]
    assert result["equal"] == 2
    assert any(line.startswith("host suites: DIFF pylate [explicit] t::a")
               for line in host_suites.summary_lines({"pylate": result}, 1.0))


def test_host_suites_mode_rows_state_the_baseline_and_the_comparison_without_exit_codes():
    runs = _runs()
    row = host_suites.mode_row("pylate", "unpatched", runs, 10.0)
    assert "4 tests: 2 pass, 1 skipped, 1 set aside (they need the Hugging Face Hub" in row and "rc=" not in row
    assert "fail" not in row.lower()     # the baseline is not a failure of this run
    assert "3 of 4 tests as unpatched" in host_suites.mode_row("pylate", "zero-code", runs, 10.0)


# ------------------------------------------------------------------ ci/install_keeps_torch.py
def test_install_check_flags_a_replaced_torch_and_a_removed_package():
    before = {"torch": ("2.13.0+cpu", "/host"), "numpy": ("2.3.0", "/host"), "ujson": ("5.12.0", "/host")}
    after = {"torch": ("2.11.0", "/env"), "numpy": ("2.3.0", "/host"), "lik_plugins": ("0.1.0", "/env")}
    added, broken = install_keeps_torch.changes(before, after)
    assert added == ["lik_plugins 0.1.0"]
    assert broken == ["torch 2.13.0+cpu (/host) -> 2.11.0 (/env)", "ujson 5.12.0: removed"]
    assert install_keeps_torch.changes(before, {**before, "x": ("1", "/env")}) == (["x 1"], [])


# ------------------------------------------------------------------ the src layout
def test_a_folder_named_like_the_package_does_not_shadow_it(tmp_path):
    """A clone in a folder called ``lik_plugins`` (links to this checkout's top-level entries)
    next to a script: the script still imports the installed package, not the folder."""
    clone = tmp_path / "lik_plugins"
    clone.mkdir()
    for entry in ROOT.iterdir():
        if not entry.name.startswith(".venv"):
            (clone / entry.name).symlink_to(entry)
    (tmp_path / "script.py").write_text("import lik_plugins\nprint(lik_plugins.__file__)\nprint(lik_plugins.pack)\n")
    proc = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    where = Path(proc.stdout.splitlines()[0])
    # a namespace package made of the folder would have no __file__ (and no ``pack``)
    assert where.name == "__init__.py" and tmp_path not in where.parents


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


def test_host_suites_end_to_end_on_a_fake_host(tmp_path, monkeypatch, capsys):
    """ci/host_suites.py's main over a host whose tests are written here: one always passes,
    one always fails (a host test that cannot pass on the machine), one fails only when
    patched (a deliberate difference, listed)."""
    sdist = tmp_path / "cache" / "fakehost-1.0"
    (sdist / "tests").mkdir(parents=True)
    (sdist / "tests" / "test_fake.py").write_text(
        "import os\n"
        "def test_ok():\n    pass\n"
        "def test_needs_the_network():\n    assert False\n"
        "def test_differs_when_patched():\n"
        "    patched = os.environ.get('LIK_HOST_SUITE_PATCH') or (os.environ.get('LIK_PATCH') and not "
        "os.environ.get('LIK_DISABLE'))\n"
        "    assert not patched\n")
    host = host_suites.Host("fakehost", "fakehost==1.0", "fakehost-1.0", "reset_routing_counts", ("tests",), ())
    monkeypatch.setattr(host_suites, "HOSTS", {"fakehost": host})
    expected = tmp_path / "expected.txt"
    monkeypatch.setattr(host_suites, "EXPECTED", expected)
    args = ["--hosts", "fakehost", "--cache", str(tmp_path / "cache")]

    expected.write_text("fakehost | tests.test_fake::test_differs_when_patched | deliberate, for the test\n")
    assert host_suites.main(args) == 0
    out = capsys.readouterr().out
    assert "rc=" not in out
    assert "unpatched  3 tests: 2 pass, 0 skipped, 1 set aside" in out
    assert "zero-code  2 of 3 tests as unpatched" in out and "disabled   3 of 3 tests as unpatched" in out
    assert ("host suites: fakehost: 2 tests equal to unpatched in every mode, 1 deliberate difference (listed), "
            "0 unexpected") in out
    assert "deliberate: tests.test_fake::test_differs_when_patched (zero-code, explicit)" in out
    # (an unlisted difference fails: test_host_suites_flags_an_unlisted_difference_...)
