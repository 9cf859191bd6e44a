"""Where `make test`'s time goes: ``python benchmarks/test_times.py [XML ...] [--labels L ...] [--out JSON]``.

`make test` writes every test's time (setup, call and teardown together) as JUnit XML to
``.cache/test-times-pure.xml`` (the in-process stage) and ``.cache/test-times.xml`` (the rest), each stage in two
workers side by side, so a stage's summed test time is more than its wall time (both are printed: the wall time is
the XML's own). This reads one or more runs (e.g. one with the
caches outside the clone emptied and a warm re-run; a run's files joined by commas), and prints and saves, per
run: the total, the time per test folder and file, the slowest tests, and with two or more runs the files whose
time differs most. It only reads the XML (issue 56's accounting; the method is in ``benchmarks/README.md``),
including the CPU probes ``tests/conftest.py`` records (fixed work timed as each stage and module starts): this
shared machine's speed swings by up to ~3x, so a run's times are read against its probes.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from results_io import save  # noqa: E402


def read(path: Path) -> dict[str, float]:
    """``{"tests/dir/test_file.py::test_name[param]": seconds}`` from one JUnit XML file."""
    out: dict[str, float] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "")
        parts = module.split(".")
        # pytest writes "tests.dir.test_file" (or "tests.dir.test_file.TestClass") as the classname
        k = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
        file = "/".join(parts[:k + 1]) + ".py"
        name = "::".join([file, *parts[k + 1:], case.get("name", "")])
        out[name] = out.get(name, 0.0) + float(case.get("time", 0.0))
    return out


def probes(path: Path) -> dict[str, float]:
    """The run's CPU probes, if recorded (``tests/conftest.py``'s ``cpu_probe_s``: seconds for fixed work, lower
    is faster): as the run started and ended, and the per-module ones (~4x shorter work) as min, median, max."""
    import statistics

    props = {prop.get("name", ""): float(prop.get("value", "nan")) for prop in ET.parse(path).getroot().iter("property")
             if prop.get("name", "").startswith("cpu_probe")}
    modules = sorted(v for k, v in props.items() if k.startswith("cpu_probe_module_s:"))
    out = {k: v for k, v in props.items() if not k.startswith("cpu_probe_module_s:")}
    if modules:
        out |= {"module_min_s": modules[0], "module_median_s": statistics.median(modules), "module_max_s": modules[-1],
                "modules": len(modules)}
    return out


def wall_s(path: Path) -> float:
    """The stage's wall time: pytest's own for the whole run (with xdist workers, less than its tests' sum)."""
    return sum(float(suite.get("time", 0.0)) for suite in ET.parse(path).getroot().iter("testsuite"))


def by(times: dict[str, float], key) -> dict[str, float]:
    """``times`` summed by ``key(test id)``, largest first."""
    sums: dict[str, float] = {}
    for name, t in times.items():
        sums[key(name)] = sums.get(key(name), 0.0) + t
    return dict(sorted(sums.items(), key=lambda kv: -kv[1]))


def file_of(name: str) -> str:
    return name.split("::")[0]


def folder_of(name: str) -> str:
    return file_of(name).rsplit("/", 1)[0]


def summary(times: dict[str, float], top: int) -> dict:
    return {"tests": len(times), "total_s": round(sum(times.values()), 1),
            "folders_s": {k: round(v, 1) for k, v in by(times, folder_of).items()},
            "files_s": {k: round(v, 1) for k, v in list(by(times, file_of).items())[:top]},
            "slowest_s": {k: round(v, 1) for k, v in sorted(times.items(), key=lambda kv: -kv[1])[:top]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("xml", nargs="*", default=[f"{ROOT}/.cache/test-times-pure.xml,{ROOT}/.cache/test-times.xml"],
                        help="one run per argument: its XML files joined by commas (make test's two stages)")
    parser.add_argument("--labels", nargs="*", help="a name for each XML file (default: the file names)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "test_times.json")
    args = parser.parse_args()
    labels = args.labels or [Path(p.split(",")[-1]).stem for p in args.xml]
    if len(labels) != len(args.xml):
        parser.error(f"{len(args.xml)} XML files but {len(labels)} labels: give one label per file")
    runs = {label: {k: v for p in paths.split(",") for k, v in read(Path(p)).items()} for label, paths in zip(labels, args.xml)}
    out: dict = {"runs": {label: summary(t, args.top) for label, t in runs.items()}}
    for label, paths in zip(labels, args.xml):  # the machine's speed as each stage started and ended
        out["runs"][label]["cpu_probe_s"] = {Path(p).stem: probes(Path(p)) for p in paths.split(",")}
        out["runs"][label]["wall_s"] = {Path(p).stem: round(wall_s(Path(p)), 1) for p in paths.split(",")}
    for label, s in out["runs"].items():
        print(f"{label}: {s['tests']} tests, {sum(s['wall_s'].values()) / 60:.1f} min wall ({s['total_s'] / 60:.1f} min "
              f"summed per test); CPU probe (s, lower is faster): "
              f"{s['cpu_probe_s']}")
        for k, v in s["folders_s"].items():
            print(f"  {v:8.1f} s  {k}")
        print("  slowest files:")
        for k, v in list(s["files_s"].items())[:15]:
            print(f"  {v:8.1f} s  {k}")
    if len(runs) > 1:
        first, *rest = labels
        files = {label: by(runs[label], file_of) for label in labels}
        for other in rest:
            diff = {f: files[other].get(f, 0.0) - t for f, t in files[first].items()}
            diff = dict(sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:args.top])
            out[f"{other}_minus_{first}_s"] = {k: round(v, 1) for k, v in diff.items()}
            print(f"{other} - {first}, by file (largest differences):")
            for k, v in list(diff.items())[:15]:
                print(f"  {v:+8.1f} s  {k}")
    save(out, args.out)


if __name__ == "__main__":
    main()
