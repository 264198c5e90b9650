"""The trace readers on the shipped synthetic samples, and on malformed files."""

from pathlib import Path

import numpy as np
import pytest

from aioprefill.bench.traces import TraceError, detect_format, read_trace

DATA = Path(__file__).parent / "data"
AZURE = DATA / "azure_sample.csv"
MOONCAKE = DATA / "mooncake_sample.jsonl"


def test_azure_sample():
    s = read_trace(AZURE)
    assert len(s) == 120
    assert s.arrivals_s[0] == 0.0 and np.all(np.diff(s.arrivals_s) >= 0)
    assert s.span_s == pytest.approx(29.378, abs=1e-3)  # 7-digit fractions, read to the microsecond
    assert s.lengths[:3].tolist() == [326, 251, 226]
    assert s.lengths.min() >= 1


def test_mooncake_sample():
    s = read_trace(MOONCAKE)
    assert len(s) == 100
    assert s.arrivals_s[0] == 0.0 and s.arrivals_s[1] == pytest.approx(0.4)
    assert s.span_s == pytest.approx(20.65)
    assert s.lengths[:2].tolist() == [867, 1303]


def test_format_detection(tmp_path):
    assert detect_format(AZURE) == "azure"
    assert detect_format(MOONCAKE) == "mooncake"
    odd = tmp_path / "trace.txt"
    odd.write_bytes(MOONCAKE.read_bytes())
    assert detect_format(odd) == "mooncake"
    assert len(read_trace(odd)) == 100
    assert len(read_trace(odd, "mooncake")) == 100


def test_numeric_timestamps_and_unsorted_rows(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n10.5,7,1\n10.0,3,1\n12.0,5,2\n")
    s = read_trace(f)
    assert s.arrivals_s.tolist() == [0.0, 0.5, 2.0]
    assert s.lengths.tolist() == [3, 7, 5]


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("a.csv", "time,tokens\n1,2\n", "header needs TIMESTAMP,ContextTokens"),
        ("b.csv", "TIMESTAMP,ContextTokens\n2023-01-01 00:00:00,12\nyesterday,3\n", "b.csv:3"),
        ("c.csv", "TIMESTAMP,ContextTokens\n1.0,0\n", "prompt length 0"),
        ("d.csv", "TIMESTAMP,ContextTokens\n", "no requests"),
        ("e.jsonl", '{"timestamp": 0, "input_length": "x"}\n', "e.jsonl:1"),
        ("f.jsonl", "not json\n", "f.jsonl:1"),
    ],
)
def test_malformed(tmp_path, name, text, match):
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(TraceError, match=match):
        read_trace(f)


def test_missing_file_and_bad_format(tmp_path):
    with pytest.raises(TraceError, match="no such file"):
        read_trace(tmp_path / "nope.csv")
    with pytest.raises(TraceError, match="unknown trace format"):
        read_trace(AZURE, "burstgpt")
