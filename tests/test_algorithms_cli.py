"""`commd algo compile`: a DSL program file (msccl-tools' imports) to checked MSCCL XML, end to end with check and simulate."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest

from commd.algorithms import mscclxml, simulator
from commd.cli.main import main

RING = textwrap.dedent("""
    import argparse
    from msccl.language import *
    from msccl.topologies import fully_connected
    from msccl.language.collectives import AllReduce

    parser = argparse.ArgumentParser()
    parser.add_argument("num_gpus", type=int)
    parser.add_argument("instances", type=int)
    parser.add_argument("--protocol", default="Simple")
    args = parser.parse_args()
    size = args.num_gpus
    with MSCCLProgram("allreduce_ring", fully_connected(size), AllReduce(size, size, True), args.instances,
                      protocol=args.protocol):
        for step in range(size - 1):
            for index in range(size):
                rank, nxt = (index + step) % size, (index + step + 1) % size
                chunk(nxt, Buffer.input, index).reduce(chunk(rank, Buffer.input, index))
        for step in range(-1, size - 2):
            for index in range(size):
                rank, nxt = (index + step) % size, (index + step + 1) % size
                chunk(rank, Buffer.input, index).copy(nxt, Buffer.input, index)
        XML()
        Check()
""")

ALLTONEXT = textwrap.dedent("""
    import sys
    from msccl.language import *
    from msccl.topologies import fully_connected
    n = int(sys.argv[1])
    with MSCCLProgram("shift", fully_connected(n), AllToNext(n, 2), 1):
        for r in range(n - 1):
            for c in range(2):
                chunk(r, Buffer.input, c).copy(r + 1, Buffer.output, c)
""")


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_an_unmodified_msccl_tools_program_compiles_checks_and_simulates(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    prog = _write(tmp_path, "ring.py", RING)
    out = tmp_path / "ring4.xml"
    assert main(["algo", "compile", "-o", str(out), str(prog), "4", "1", "--protocol", "Simple"]) == 0
    assert "checked" in capsys.readouterr().out
    algo = mscclxml.load(out)
    assert (algo.name, algo.coll, algo.ngpus, algo.inplace, algo.proto) == ("allreduce_ring", "allreduce", 4, True,
                                                                             "Simple")
    assert main(["algo", "check", str(out)]) == 0
    assert main(["algo", "simulate", str(out), "--count", "1001", "--dtype", "int64"]) == 0
    rng = np.random.default_rng(1)
    inputs = [rng.integers(-99, 99, 1001) for _ in range(4)]
    for got in simulator.simulate(algo, inputs, "sum"):
        np.testing.assert_array_equal(got, np.sum(inputs, axis=0))


def test_a_custom_collective_gets_its_postcondition_beside_it(tmp_path: Path) -> None:
    out = tmp_path / "shift.xml"
    assert main(["algo", "compile", "-o", str(out), str(_write(tmp_path, "a2n.py", ALLTONEXT)), "3"]) == 0
    side = json.loads((tmp_path / "shift.post.json").read_text())
    # rank r's output chunk c comes from rank r-1's input chunk c: the shift, as the sidecar states it
    want = sorted((r, c, r - 1, c) for r in (1, 2) for c in (0, 1))
    got = sorted((e["rank"], e["index"], e["from"]["rank"], e["from"]["index"]) for e in side["expect"])
    assert got == want
    assert main(["algo", "check", str(out)]) == 0  # finds shift.post.json by itself
    assert main(["algo", "simulate", str(out), "--count", "10", "--dtype", "int64"]) == 0


def test_a_program_that_fails_is_refused_and_nothing_is_written(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    broken = _write(tmp_path, "bad.py", RING.replace("chunk(nxt, Buffer.input, index).reduce",
                                                     "chunk(nxt, Buffer.input, index + size).reduce"))
    out = tmp_path / "bad.xml"
    assert main(["algo", "compile", "-o", str(out), str(broken), "3", "1"]) == 1
    said = capsys.readouterr().out
    assert "refused" in said and "bad.py" in said
    assert not out.exists()


def test_a_file_that_builds_two_programs_writes_one_file_each(tmp_path: Path) -> None:
    text = ALLTONEXT + ALLTONEXT.split("n = int(sys.argv[1])")[1].replace('"shift"', '"shift2"')
    out = tmp_path / "many.xml"
    assert main(["algo", "compile", "-o", str(out), str(_write(tmp_path, "two.py", text)), "2"]) == 0
    assert sorted(p.name for p in tmp_path.glob("many-*.xml")) == ["many-shift.xml", "many-shift2.xml"]
    assert not out.exists()


def test_the_docs_example_program_compiles_checks_and_simulates(tmp_path: Path) -> None:
    """The programs page's two-shot example, as a user would copy it, through the page's commands."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "programs.md").read_text()
    after = page.split("## Writing one", 1)[1]
    program = after.split("```python\n", 1)[1].split("```", 1)[0]
    prog = _write(tmp_path, "twoshot.py", program)
    out = tmp_path / "my_twoshot.xml"
    assert main(["algo", "compile", "-o", str(out), str(prog), "4"]) == 0
    assert main(["algo", "check", str(out)]) == 0
    assert main(["algo", "simulate", str(out), "--count", "1000", "--dtype", "float32", "--trace"]) == 0
    assert mscclxml.load(out).name == "my_twoshot"
