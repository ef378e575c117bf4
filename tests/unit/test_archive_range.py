"""`bus.archive.read_range`: the stretch of history a reader behind a trim reads back, from just the
segments that hold it, each sequence once (segments may overlap), and an error naming the hole when
the archive does not cover it."""

from __future__ import annotations

import pytest

from rolectl.bus.archive import ArchiveError, read_range, write_segment
from rolectl.sync_protocol import MemberRef, Recorded, Role, RoundClosed, RoundOutcome, StepFinished

_EXPLORER = MemberRef(role=Role.EXPLORER, id="explorer-0", incarnation=1)


def _records(first: int, last: int) -> list[Recorded]:
    out = []
    for seq in range(first, last + 1):
        out.append(Recorded(seq=seq, time_ms=1000 + seq, event=StepFinished(member=_EXPLORER, step=seq, version=0),
                            subject="rft.j.evt.explorer.explorer-0.step_finished"))
        if seq % 4 == 0:  # a decision batch: two records that share one sequence
            for round_id in (seq, seq + 100):
                out.append(Recorded(seq=seq, time_ms=1000 + seq, subject="rft.j.sync.log",
                                    event=RoundClosed(round=round_id, cause_seq=seq - 1,
                                                      outcome=RoundOutcome.COMPLETED)))
    return out


@pytest.fixture
def archive(tmp_path):
    write_segment(tmp_path, _records(1, 5))
    write_segment(tmp_path, _records(4, 9))  # overlaps the first
    write_segment(tmp_path, _records(12, 15))  # after a hole: 10, 11 were never archived
    return tmp_path


def test_a_range_across_overlapping_segments_holds_each_record_once(archive):
    got = read_range(archive, 3, 9)
    assert got == _records(3, 9)
    assert [r.seq for r in got].count(8) == 3  # the step and both decisions of the batch at seq 8


def test_a_range_inside_one_segment(archive):
    assert read_range(archive, 13, 14) == _records(13, 14)


@pytest.mark.parametrize(("first", "last", "upto"), [(8, 13, 9), (14, 20, 15), (1, 11, 9)])
def test_a_range_the_archive_does_not_cover_is_an_error_naming_it(archive, first, last, upto):
    with pytest.raises(ArchiveError, match=f"records {first}..{last} .* only up to {upto}"):
        read_range(archive, first, last)
