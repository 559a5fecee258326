"""MSCCL's XML read and written: third-party files load exactly as an independent reader sees them,
round-trip unchanged, and every kind of broken or hostile file is refused naming where and why."""

from __future__ import annotations

import collections
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from helpers import msccl_files_dir

from commd.algorithms import mscclxml
from commd.algorithms.errors import ProgramError
from commd.algorithms.ir import Algorithm, Rank, Step, StepType, Threadblock

MSCCL_DIR = msccl_files_dir()
FILES = sorted(MSCCL_DIR.glob("*.xml")) if MSCCL_DIR else []
needs_files = pytest.mark.skipif(MSCCL_DIR is None, reason="the third-party MSCCL files (shared/msccl) are not here")

# Counted in the files' text with grep (independent of any XML reader):
# gpus, threadblocks, steps, channels used, steps per type.
FACTS = {
    "NEG_ns3_peer2peer_8r_labelled_allgather.xml": (8, 8, 16, {0}, {"r": 8, "s": 8}),
    "a2a_allpairs_4r.xml": (4, 24, 28, {0}, {"cpy": 4, "r": 12, "s": 12}),
    "a2a_twostep_2x2.xml": (4, 16, 36, {0, 4, 5}, {"cpy": 8, "nop": 4, "r": 12, "s": 12}),
    "ag_2r_handwritten.xml": (2, 2, 6, {0}, {"cpy": 2, "r": 2, "s": 2}),
    "ag_syccl_4r_outofplace.xml": (4, 16, 28, {0}, {"cpy": 4, "r": 12, "s": 12}),
    "alltonext_fwd_2x8_16r.xml": (16, 66, 66, {0, 1}, {"r": 30, "rcs": 6, "s": 30}),
    "ar_allpairs_4r_scratch.xml": (4, 16, 140, {0}, {"nop": 44, "r": 24, "re": 48, "s": 24}),
    "ar_bintree_4r_2chunks.xml": (4, 9, 18, {0}, {"r": 4, "rcs": 2, "rrc": 2, "rrcs": 2, "rrs": 2, "s": 6}),
    "ar_hierarchical_2x2.xml": (4, 24, 40, {0, 1}, {"r": 8, "rcs": 4, "rrc": 8, "rrs": 4, "s": 16}),
    "ar_rdh_4r.xml": (4, 8, 32, {0}, {"r": 8, "rrc": 8, "s": 16}),
    "ar_ring_4r_fused.xml": (4, 4, 28, {1}, {"r": 4, "rcs": 8, "rrcs": 4, "rrs": 8, "s": 4}),
    "custom_3r_fanout.xml": (3, 4, 4, {0, 1}, {"r": 2, "s": 2}),
}

# MSCCL's attribute order, element by element (as msccl-tools writes it).
ORDER = {
    "algo": ["name", "proto", "nchannels", "nchunksperloop", "ngpus", "coll", "inplace",
             "outofplace", "minBytes", "maxBytes"],
    "gpu": ["id", "i_chunks", "o_chunks", "s_chunks"],
    "tb": ["id", "send", "recv", "chan"],
    "step": ["s", "type", "srcbuf", "srcoff", "dstbuf", "dstoff", "cnt", "depid", "deps", "hasdep"],
}


def _ir_as_attributes(algo: Algorithm) -> tuple:
    """The IR as the XML attribute strings it stands for, nested like the elements."""
    head = {"name": algo.name, "proto": algo.proto, "nchannels": str(algo.nchannels),
            "nchunksperloop": str(algo.nchunksperloop), "ngpus": str(algo.ngpus), "coll": algo.coll,
            "inplace": str(int(algo.inplace))}
    if algo.outofplace is not None:
        head["outofplace"] = str(int(algo.outofplace))
    if algo.min_bytes is not None:
        head["minBytes"] = str(algo.min_bytes)
    if algo.max_bytes is not None:
        head["maxBytes"] = str(algo.max_bytes)
    gpus = []
    for rank in algo.ranks:
        tbs = []
        for tb in rank.threadblocks:
            steps = [{"s": str(st.s), "type": st.type.value, "srcbuf": st.srcbuf, "srcoff": str(st.srcoff),
                      "dstbuf": st.dstbuf, "dstoff": str(st.dstoff), "cnt": str(st.cnt), "depid": str(st.depid),
                      "deps": str(st.deps), "hasdep": str(int(st.hasdep))} for st in tb.steps]
            tbs.append(({"id": str(tb.id), "send": str(tb.send), "recv": str(tb.recv), "chan": str(tb.chan)}, steps))
        gpus.append(({"id": str(rank.id), "i_chunks": str(rank.i_chunks), "o_chunks": str(rank.o_chunks),
                      "s_chunks": str(rank.s_chunks)}, tbs))
    return head, gpus


def _tree_as_attributes(root: ET.Element) -> tuple:
    """An ElementTree read of a file, nested the same way (elements in document order)."""
    assert root.tag == "algo"
    gpus = []
    for gpu in root:
        assert gpu.tag == "gpu"
        tbs = []
        for tb in gpu:
            assert tb.tag == "tb"
            assert all(step.tag == "step" and len(step) == 0 for step in tb)
            tbs.append((dict(tb.attrib), [dict(step.attrib) for step in tb]))
        gpus.append((dict(gpu.attrib), tbs))
    return dict(root.attrib), gpus


# -- the third-party files ------------------------------------------------------------------------

@needs_files
def test_the_third_party_files_are_all_here() -> None:
    assert {f.name for f in FILES} == set(FACTS)


@needs_files
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_file_loads_as_an_independent_reader_sees_it(path: Path) -> None:
    algo = mscclxml.load(path)
    assert _ir_as_attributes(algo) == _tree_as_attributes(ET.parse(path).getroot())


@needs_files
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_file_facts_counted_in_its_text(path: Path) -> None:
    algo = mscclxml.load(path)
    gpus, tbs, steps, chans, types = FACTS[path.name]
    assert algo.ngpus == gpus == len(algo.ranks)
    assert [r.id for r in algo.ranks] == list(range(gpus))
    all_tbs = [tb for r in algo.ranks for tb in r.threadblocks]
    assert len(all_tbs) == tbs
    assert sum(len(tb.steps) for tb in all_tbs) == steps
    assert {tb.chan for tb in all_tbs} == chans
    assert collections.Counter(st.type.value for tb in all_tbs for st in tb.steps) == types


@needs_files
def test_specific_attributes_of_the_files() -> None:
    """Hand-read from the files' first lines and README."""
    neg = mscclxml.load(MSCCL_DIR / "NEG_ns3_peer2peer_8r_labelled_allgather.xml")
    assert (neg.proto, neg.coll, neg.inplace, neg.outofplace, neg.min_bytes, neg.max_bytes) == \
        ("LL", "allgather", True, False, 0, 0)
    assert {(r.i_chunks, r.o_chunks, r.s_chunks) for r in neg.ranks} == {(0, 2, 0)}

    ring = mscclxml.load(MSCCL_DIR / "ar_ring_4r_fused.xml")
    assert (ring.name, ring.nchannels, ring.nchunksperloop, ring.inplace) == \
        ("allreduce_ring_1channelsperring", 2, 4, True)
    assert (ring.outofplace, ring.min_bytes, ring.max_bytes) == (None, None, None)  # an older file
    first = ring.ranks[0].threadblocks[0]
    assert (first.send, first.recv, first.chan) == (1, 3, 1)
    assert first.steps[3] == Step(s=3, type=StepType.RECV_REDUCE_COPY_SEND, srcbuf="i", srcoff=1, dstbuf="i",
                                  dstoff=1, cnt=1)

    syccl = mscclxml.load(MSCCL_DIR / "ag_syccl_4r_outofplace.xml")
    assert (syccl.inplace, syccl.outofplace, syccl.min_bytes, syccl.max_bytes) == (False, True, 0, 0)
    dep = syccl.ranks[0].threadblocks[2].steps[1]
    assert (dep.depid, dep.deps, dep.dependency) == (1, 0, (1, 0))
    assert syccl.ranks[0].threadblocks[1].steps[0].hasdep is True

    twostep = mscclxml.load(MSCCL_DIR / "a2a_twostep_2x2.xml")
    nop = twostep.ranks[0].threadblocks[3].steps[0]
    assert (nop.type, nop.srcoff, nop.dstoff, nop.cnt, nop.dependency) == (StepType.NOP, -1, -1, 0, (0, 0))
    assert twostep.ranks[0].s_chunks == 2 and twostep.nchannels == 6

    custom = mscclxml.load(MSCCL_DIR / "custom_3r_fanout.xml")
    assert custom.coll == "custom"
    assert [(r.i_chunks, r.o_chunks) for r in custom.ranks] == [(1, 0), (0, 1), (0, 1)]


@needs_files
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_round_trip_keeps_the_program_and_the_elements(path: Path) -> None:
    algo = mscclxml.load(path)
    written = mscclxml.dumps(algo)
    assert mscclxml.loads(written) == algo
    assert _tree_as_attributes(ET.fromstring(written)) == _tree_as_attributes(ET.parse(path).getroot())
    for line in written.splitlines():
        match = re.fullmatch(r"( *)<(\w+)((?: \w+=\"[^\"]*\")*)/?>|( *)</(\w+)>", line)
        assert match, line
        if match.group(2):
            names = re.findall(r" (\w+)=", match.group(3))
            assert names == [n for n in ORDER[match.group(2)] if n in names], line
            depth = ["algo", "gpu", "tb", "step"].index(match.group(2))
            assert match.group(1) == "  " * depth, line


@needs_files
@pytest.mark.parametrize("path", [f for f in FILES if not f.name.startswith("NEG_")], ids=lambda p: p.name)
def test_files_in_msccl_tools_layout_are_written_back_byte_for_byte(path: Path) -> None:
    """All but the NEG file (four-space indentation, no final newline) are in msccl-tools' layout."""
    text = path.read_text()
    assert mscclxml.dumps(mscclxml.loads(text)) == text


# -- writing --------------------------------------------------------------------------------------

def _small(**overrides) -> Algorithm:
    """A 2-rank all-gather by hand: each rank sends its chunk and receives the other's."""
    def rank(r: int) -> Rank:
        steps = (Step(s=0, type=StepType.SEND, srcbuf="i", srcoff=0, dstbuf="o", dstoff=r, cnt=1),
                 Step(s=1, type=StepType.RECV, srcbuf="i", srcoff=0, dstbuf="o", dstoff=1 - r, cnt=1, depid=0,
                      deps=0, hasdep=True))
        return Rank(id=r, i_chunks=1, o_chunks=2, s_chunks=0,
                    threadblocks=(Threadblock(id=0, send=1 - r, recv=1 - r, chan=0, steps=steps),))
    fields = dict(name="ag2", coll="allgather", ngpus=2, nchunksperloop=2, nchannels=1, inplace=False,
                  ranks=(rank(0), rank(1)))
    fields.update(overrides)
    return Algorithm(**fields)


def test_optional_attributes_written_only_when_set() -> None:
    old = mscclxml.dumps(_small())
    assert old.splitlines()[0] == ('<algo name="ag2" proto="Simple" nchannels="1" nchunksperloop="2" ngpus="2" '
                                   'coll="allgather" inplace="0">')
    new = mscclxml.dumps(_small(outofplace=True, min_bytes=0, max_bytes=1 << 40))
    assert new.splitlines()[0].endswith('inplace="0" outofplace="1" minBytes="0" maxBytes="1099511627776">')
    assert mscclxml.loads(new).max_bytes == 1 << 40
    only_max = mscclxml.dumps(_small(max_bytes=4096))
    assert 'maxBytes="4096"' in only_max and "minBytes" not in only_max and "outofplace" not in only_max


def test_hand_made_program_written_exactly() -> None:
    expected = """\
<algo name="ag2" proto="LL128" nchannels="1" nchunksperloop="2" ngpus="2" coll="allgather" inplace="0">
  <gpu id="0" i_chunks="1" o_chunks="2" s_chunks="0">
    <tb id="0" send="1" recv="1" chan="0">
      <step s="0" type="s" srcbuf="i" srcoff="0" dstbuf="o" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="r" srcbuf="i" srcoff="0" dstbuf="o" dstoff="1" cnt="1" depid="0" deps="0" hasdep="1"/>
    </tb>
  </gpu>
  <gpu id="1" i_chunks="1" o_chunks="2" s_chunks="0">
    <tb id="0" send="0" recv="0" chan="0">
      <step s="0" type="s" srcbuf="i" srcoff="0" dstbuf="o" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="r" srcbuf="i" srcoff="0" dstbuf="o" dstoff="0" cnt="1" depid="0" deps="0" hasdep="1"/>
    </tb>
  </gpu>
</algo>
"""
    algo = _small(proto="LL128")
    assert mscclxml.dumps(algo) == expected
    assert mscclxml.loads(expected) == algo


def test_empty_rank_and_threadblock_round_trip() -> None:
    idle = Rank(id=1, i_chunks=0, o_chunks=0, s_chunks=0, threadblocks=())
    waiting = Rank(id=0, i_chunks=1, o_chunks=0, s_chunks=0,
                   threadblocks=(Threadblock(id=0, send=-1, recv=-1, chan=0, steps=()),))
    algo = _small(coll="custom", ranks=(waiting, idle))
    text = mscclxml.dumps(algo)
    assert '  <gpu id="1" i_chunks="0" o_chunks="0" s_chunks="0"/>' in text.splitlines()
    assert mscclxml.loads(text) == algo


def test_name_with_markup_characters_round_trips() -> None:
    algo = _small(name='a&b <"c"> \'d\'')
    assert mscclxml.loads(mscclxml.dumps(algo)) == algo


def test_dump_and_load_a_file(tmp_path: Path) -> None:
    path = tmp_path / "ag2.xml"
    mscclxml.dump(_small(), path)
    assert mscclxml.load(path) == _small()
    assert mscclxml.load(str(path)) == _small()


def test_dumps_refuses_an_ir_with_wrong_python_types() -> None:
    with pytest.raises(ProgramError, match="expected an integer"):
        mscclxml.dumps(_small(ngpus="2"))
    with pytest.raises(ProgramError, match="expected a bool"):
        mscclxml.dumps(_small(inplace=0))


# -- refusals -------------------------------------------------------------------------------------

GOOD = """\
<algo name="t" proto="Simple" nchannels="1" nchunksperloop="2" ngpus="2" coll="allgather" inplace="0">
  <gpu id="0" i_chunks="1" o_chunks="2" s_chunks="0">
    <tb id="0" send="1" recv="1" chan="0">
      <step s="0" type="s" srcbuf="i" srcoff="0" dstbuf="o" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="r" srcbuf="i" srcoff="0" dstbuf="o" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
  </gpu>
  <gpu id="1" i_chunks="1" o_chunks="2" s_chunks="0">
    <tb id="0" send="0" recv="0" chan="0">
      <step s="0" type="s" srcbuf="i" srcoff="0" dstbuf="o" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="r" srcbuf="i" srcoff="0" dstbuf="o" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
  </gpu>
</algo>
"""
# Line 11 is rank 1, threadblock 0, step 1 (the last step); line 8 is <gpu id="1">; line 9 its <tb>.
LAST_STEP = 11


def _edit_line(line: int, old: str, new: str, text: str = GOOD) -> str:
    lines = text.split("\n")
    assert old in lines[line - 1], (old, lines[line - 1])
    lines[line - 1] = lines[line - 1].replace(old, new, 1)
    return "\n".join(lines)


def _refused(text: str, source: str = "bad.xml") -> ProgramError:
    with pytest.raises(ProgramError) as info:
        mscclxml.loads(text, source=source)
    assert info.value.source == source
    return info.value


def test_the_template_is_accepted() -> None:
    algo = mscclxml.loads(GOOD)
    assert algo.ranks[1].threadblocks[0].steps[1].dstoff == 0


@pytest.mark.parametrize("value", ["1.5", "1e3", "", " 1", "1 ", "+1", "0x1", "1_0", "\uff11", "one",
                                   "9" * 40])
def test_an_attribute_that_is_not_a_plain_integer_is_refused(value: str) -> None:
    err = _refused(_edit_line(LAST_STEP, 'cnt="1"', f'cnt="{value}"'))
    assert (err.rank, err.threadblock, err.step) == (1, 0, 1)
    assert f"<step> attribute cnt={value!r} is not an integer" in err.reason
    assert f"(line {LAST_STEP})" in err.reason


@pytest.mark.parametrize(("line", "old", "new", "where", "reason"), [
    (LAST_STEP, 'cnt="1"', 'cnt="-1"', (1, 0, 1), "cnt=-1 must be ≥ 0"),
    (LAST_STEP, 'dstoff="0"', 'dstoff="-1"', (1, 0, 1), "dstoff=-1 must be ≥ 0"),
    (LAST_STEP, 'depid="-1"', 'depid="-2"', (1, 0, 1), "depid=-2 must be -1 or ≥ 0"),
    (9, 'send="0"', 'send="-3"', (1, 0, None), "send=-3 must be -1 or ≥ 0"),
    (9, 'chan="0"', 'chan="-1"', (1, 0, None), "chan=-1 must be ≥ 0"),
    (8, 's_chunks="0"', 's_chunks="2147483648"', (1, None, None), "s_chunks=2147483648 is over 2147483647"),
    (1, 'ngpus="2"', 'ngpus="0"', (None, None, None), "ngpus=0 must be ≥ 1"),
    (1, 'nchannels="1"', 'nchannels="0"', (None, None, None), "nchannels=0 must be ≥ 1"),
])
def test_an_integer_out_of_range_is_refused(line: int, old: str, new: str, where: tuple, reason: str) -> None:
    err = _refused(_edit_line(line, old, new))
    assert (err.rank, err.threadblock, err.step) == where
    assert reason in err.reason and f"(line {line})" in err.reason


def test_nop_may_carry_unused_offsets_of_minus_one() -> None:
    text = _edit_line(LAST_STEP, 'type="r" srcbuf="i" srcoff="0" dstbuf="o" dstoff="0" cnt="1"',
                      'type="nop" srcbuf="i" srcoff="-1" dstbuf="o" dstoff="-1" cnt="0"')
    step = mscclxml.loads(text).ranks[1].threadblocks[0].steps[1]
    assert (step.type, step.srcoff, step.dstoff, step.cnt) == (StepType.NOP, -1, -1, 0)


@pytest.mark.parametrize(("line", "old", "new", "where", "reason"), [
    (LAST_STEP, 'type="r"', 'type="rr"', (1, 0, 1), "type='rr' is not a known step type"),
    (LAST_STEP, 'type="r"', 'type="R"', (1, 0, 1), "type='R' is not a known step type"),
    (LAST_STEP, 'srcbuf="i"', 'srcbuf="sc"', (1, 0, 1), "srcbuf='sc' is not a buffer (i, o, s)"),
    (LAST_STEP, 'hasdep="0"', 'hasdep="yes"', (1, 0, 1), "hasdep='yes' must be 0 or 1"),
    (LAST_STEP, 'depid="-1"', 'depid="0"', (1, 0, 1), "depid=0 and deps=-1: both -1"),
    (1, 'inplace="0"', 'inplace="2"', (None, None, None), "inplace='2' must be 0 or 1"),
    (1, 'inplace="0"', 'inplace="0" outofplace="true"', (None, None, None), "outofplace='true' must be 0 or 1"),
    (1, 'coll="allgather"', 'coll="allgatherv"', (None, None, None), "coll='allgatherv' is not a known collective"),
    (1, 'proto="Simple"', 'proto="simple"', (None, None, None), "proto='simple' is not one of MSCCL's protocols"),
    (1, 'name="t"', 'name=""', (None, None, None), "name='' must be"),
    (1, 'name="t"', 'name="a&#10;b"', (None, None, None), "name='a\\nb' must be"),
    (1, 'inplace="0"', 'inplace="0" maxBytes="-5"', (None, None, None), "maxBytes=-5 must be ≥ 0"),
])
def test_a_bad_value_is_refused(line: int, old: str, new: str, where: tuple, reason: str) -> None:
    err = _refused(_edit_line(line, old, new))
    assert (err.rank, err.threadblock, err.step) == where
    assert reason in err.reason and f"(line {line})" in err.reason


@pytest.mark.parametrize(("line", "old", "new", "where", "reason"), [
    (LAST_STEP, 'hasdep="0"', 'hasdep="0" channel="2"', (1, 0, 1), "<step> has unknown attribute channel"),
    (9, 'chan="0"', 'chan="0" rank="1" x="2"', (1, 0, None), "<tb> has unknown attributes rank, x"),
    (1, 'inplace="0"', 'inplace="0" ninstances="2"', (None, None, None), "<algo> has unknown attribute ninstances"),
    (LAST_STEP, ' hasdep="0"', '', (1, 0, 1), "<step> lacks attribute hasdep"),
    (LAST_STEP, ' depid="-1" deps="-1"', '', (1, 0, 1), "<step> lacks attributes depid, deps"),
    (8, ' o_chunks="2"', '', (1, None, None), "<gpu> lacks attribute o_chunks"),
    (1, ' coll="allgather"', '', (None, None, None), "<algo> lacks attribute coll"),
])
def test_unknown_and_missing_attributes_are_refused(line: int, old: str, new: str, where: tuple,
                                                     reason: str) -> None:
    err = _refused(_edit_line(line, old, new))
    assert (err.rank, err.threadblock, err.step) == where
    assert reason in err.reason and f"(line {line})" in err.reason


def test_unknown_elements_and_text_are_refused() -> None:
    err = _refused(_edit_line(LAST_STEP, "/>", "><note/></step>"))
    assert (err.rank, err.threadblock, err.step) == (1, 0, 1)
    assert "<note> inside <step>: <step> has no child elements" in err.reason
    err = _refused(_edit_line(9, "<tb ", '<barrier/><tb '))
    assert (err.rank, err.threadblock, err.step) == (1, None, None)
    assert "unknown element <barrier> inside <gpu>: only <tb> may appear there" in err.reason
    err = _refused(GOOD.replace("<algo ", "<msccl:algo xmlns:msccl='x' ", 1).replace("</algo>", "</msccl:algo>"))
    assert "unknown element <msccl:algo> as the root" in err.reason
    err = _refused(_edit_line(10, "<step", "run fast <step"))
    assert (err.rank, err.threadblock) == (1, 0)
    assert "text 'run fast' inside <tb>" in err.reason


def test_gpu_ids_out_of_order_duplicate_missing_or_too_many_are_refused() -> None:
    err = _refused(_edit_line(8, 'id="1"', 'id="2"', GOOD.replace('ngpus="2"', 'ngpus="3"')))
    assert err.rank == 2 and "<gpu id=2> out of order: expected id=1" in err.reason and "(line 8)" in err.reason
    err = _refused(_edit_line(8, 'id="1"', 'id="0"'))
    assert err.rank == 0 and "duplicate <gpu id=0>" in err.reason and "(line 8)" in err.reason
    err = _refused(GOOD.replace('ngpus="2"', 'ngpus="4"'))
    assert "ngpus=4 but <gpu id> 2..3 missing" in err.reason and "(line 14)" in err.reason
    err = _refused(GOOD.replace('ngpus="2"', 'ngpus="3"'))
    assert "ngpus=3 but <gpu id> 2 missing" in err.reason
    err = _refused(GOOD.replace('ngpus="2"', 'ngpus="1"'))
    assert err.rank == 1 and "<gpu id=1> is outside 0..0 (ngpus=1)" in err.reason


def test_threadblock_and_step_ids_out_of_order_or_duplicate_are_refused() -> None:
    err = _refused(_edit_line(LAST_STEP, 's="1"', 's="0"'))
    assert (err.rank, err.threadblock, err.step) == (1, 0, 0)
    assert "duplicate <step s=0>" in err.reason and f"(line {LAST_STEP})" in err.reason
    err = _refused(_edit_line(LAST_STEP, 's="1"', 's="2"'))
    assert (err.rank, err.threadblock, err.step) == (1, 0, 2)
    assert "<step s=2> out of order: expected s=1" in err.reason
    err = _refused(_edit_line(9, 'id="0"', 'id="1"'))
    assert (err.rank, err.threadblock) == (1, 1) and "<tb id=1> out of order: expected id=0" in err.reason
    second_tb = '    <tb id="0" send="-1" recv="-1" chan="0"/>\n  </gpu>\n</algo>'
    err = _refused(GOOD.replace("  </gpu>\n</algo>", second_tb))
    assert (err.rank, err.threadblock) == (1, 0) and "duplicate <tb id=0>" in err.reason


BILLION_LAUGHS = """<?xml version="1.0"?>
<!DOCTYPE algo [
  <!ENTITY lol "lol">
  <!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
  <!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">
]>
<algo name="&lol3;" proto="Simple" nchannels="1" nchunksperloop="1" ngpus="1" coll="custom" inplace="0">
  <gpu id="0" i_chunks="0" o_chunks="0" s_chunks="0"/>
</algo>
"""


def test_doctype_and_entity_declarations_are_refused_before_parsing() -> None:
    err = _refused(BILLION_LAUGHS)
    assert "<!DOCTYPE> declaration is refused" in err.reason and "(line 2)" in err.reason
    err = _refused(BILLION_LAUGHS.replace("<!DOCTYPE", "<!doctype"))
    assert "<!DOCTYPE> declaration is refused" in err.reason
    external = GOOD.replace("<algo ", '<!DOCTYPE algo SYSTEM "file:///etc/passwd">\n<algo ', 1)
    assert "<!DOCTYPE> declaration is refused" in _refused(external).reason


def test_malformed_xml_is_refused_with_the_parsers_line() -> None:
    truncated = GOOD[:GOOD.index("<step", GOOD.index('<gpu id="1"')) + 20]
    err = _refused(truncated)
    assert err.reason.startswith("malformed XML:") and "(line 10," in err.reason
    err = _refused("")
    assert err.reason.startswith("malformed XML: no element found")
    err = _refused(_edit_line(LAST_STEP, 'cnt="1"', 'cnt="1" cnt="1"'))
    assert "duplicate attribute" in err.reason and f"(line {LAST_STEP}," in err.reason
    err = _refused(GOOD + GOOD)
    assert "junk after document element" in err.reason


def test_too_big_text_is_refused() -> None:
    err = _refused(" " * (mscclxml.MAX_BYTES + 1))
    assert "64 MiB limit" in err.reason


def test_too_big_file_is_refused_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "huge.xml"
    with open(path, "wb") as f:
        f.truncate(mscclxml.MAX_BYTES + 1)  # sparse: costs no disk and no time
    with pytest.raises(ProgramError, match="64 MiB limit") as info:
        mscclxml.load(path)
    assert info.value.source == str(path)


def test_unreadable_or_non_utf8_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ProgramError, match="cannot read the file") as info:
        mscclxml.load(tmp_path / "absent.xml")
    assert info.value.source == str(tmp_path / "absent.xml")
    path = tmp_path / "latin1.xml"
    path.write_bytes(GOOD.replace('name="t"', 'name="caf\xe9"').encode("latin-1"))
    with pytest.raises(ProgramError, match="not UTF-8 text"):
        mscclxml.load(path)


def test_file_refusals_name_the_path(tmp_path: Path) -> None:
    path = tmp_path / "bad.xml"
    path.write_text(_edit_line(LAST_STEP, 'type="r"', 'type="recv"'))
    with pytest.raises(ProgramError) as info:
        mscclxml.load(path)
    assert str(info.value).startswith(f"{path}, rank 1, threadblock 0, step 1: <step> attribute type='recv'")


def test_declaration_comments_crlf_and_bom_are_accepted(tmp_path: Path) -> None:
    """What XML tools add around the same program changes nothing."""
    decorated = '<?xml version="1.0" encoding="UTF-8"?>\n<!-- made by hand -->\n' + GOOD.replace(
        "<gpu id=\"1\"", "<!-- the second rank --><gpu id=\"1\"")
    assert mscclxml.loads(decorated.replace("\n", "\r\n")) == mscclxml.loads(GOOD)
    path = tmp_path / "bom.xml"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD.encode())
    assert mscclxml.load(path) == mscclxml.loads(GOOD)


def test_refusals_quote_long_values_cut_short() -> None:
    err = _refused(_edit_line(LAST_STEP, 'type="r"', f'type="{"x" * 100_000}"'))
    assert f"type={'x' * 40!r}… is not a known step type" in err.reason and len(str(err)) < 300
