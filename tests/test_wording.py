"""Counts in messages take the noun's number: "1 byte", never "1 bytes"; lists read as prose:
"a, b and c", never "a and b and c" or " and a" (`megapar.wording`)."""

import pytest

from megapar.data.indexed import IndexedDataset
from megapar.data.sampler import GlobalBatchSampler
from megapar.mesh import Layout, LayoutError
from megapar.wording import and_list, counted, first_few, or_list


def test_counted_names_one_in_the_singular_and_any_other_in_the_plural():
    assert [counted(n, "byte") for n in (0, 1, 2, 1234)] == [
        "0 bytes", "1 byte", "2 bytes", "1,234 bytes"]
    assert counted(1, "micro-batch", "micro-batches") == "1 micro-batch"
    assert counted(3, "micro-batch", "micro-batches") == "3 micro-batches"
    assert counted(1, "document index", "document indices") == "1 document index"


def test_messages_with_a_count_of_one_say_it_in_the_singular(tmp_path):
    with pytest.raises(ValueError, match=r"the dataset has 1 sample, fewer than one global "):
        GlobalBatchSampler(1, 4, 1, 1, 0, 0)
    with pytest.raises(LayoutError, match=r"= 1; launch 1 process or change --tp/--pp/--dp$"):
        Layout.infer(2, 1, 1, 1)
    (tmp_path / "d.idx").write_bytes(b"x")
    (tmp_path / "d.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"is truncated or another file \(1 byte\)"):
        IndexedDataset(str(tmp_path / "d"))


def test_lists_in_messages_read_as_prose_at_any_length():
    assert [and_list(["a", "b", "c"][:n]) for n in (1, 2, 3)] == ["a", "a and b", "a, b and c"]
    assert [or_list(["a", "b", "c"][:n]) for n in (1, 2, 3)] == ["a", "a or b", "a, b or c"]
    assert [first_few(["a", "b", "c", "d", "e"][:n], 3) for n in (1, 2, 3, 5)] == [
        "a", "a and b", "a, b and c", "a, b, c and 2 more"]  # "a, b" read as a cut list


def test_three_flags_an_export_reads_are_named_once_each_without_to_hf(capsys):
    """megapar-convert's refusal of export-only flags without --to-hf names three as prose."""
    from megapar.cli.convert import main as convert

    assert convert(["a", "b", "--tokenizer", "gpt2", "--tokenizer-rows", "--dtype",
                    "bfloat16"]) == 2
    err = capsys.readouterr().err
    assert "--tokenizer, --tokenizer-rows and --dtype are used only with --to-hf" in err, err
