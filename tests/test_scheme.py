"""Scheme text form: parse <-> print round trip, and validation messages."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ttile.core.scheme import Block, Loop, Scheme, SchemeError, Seq, lower
from ttile.core.spec import ConvSpec

PAPER_YOLO13 = ("[T16 k; T1 h; Lseq h [(2,11),(1,12)]; T17 w; T1 h; T1 h; T3 s; T3 r; T2 w; "
                "T256 c; U beta h; U2 k; V k]")
YOLO12 = ConvSpec(1, 512, 256, 34, 34, 3, 3, pad_top=1, pad_bottom=1, pad_left=1, pad_right=1)


def test_paper_scheme_round_trips():
    scheme = Scheme.parse(PAPER_YOLO13)
    assert str(scheme) == PAPER_YOLO13
    assert Scheme.parse(str(scheme)) == scheme


def test_parser_accepts_spacing_and_lambda_spelling():
    loose = Scheme.parse("[ PR n ;T16  k; λseq h [ (2, 11) , (1,12) ]; U beta h ; U2k; Vk ]")
    assert str(loose) == "[PR n; T16 k; Lseq h [(2,11),(1,12)]; U beta h; U2 k; V k]"


def test_lowering_rewrites_lseq_into_seq_with_offsets():
    tree = lower(Scheme.parse(PAPER_YOLO13), YOLO12)
    assert isinstance(tree, Loop) and (tree.dim, tree.count, tree.step) == ("k", 16, 32)
    seq = tree.body.body
    assert isinstance(seq, Seq) and seq.dim == "h" and seq.offsets == (0, 22)
    first, second = seq.branches
    assert (first.count, first.step, second.count, second.step) == (2, 11, 1, 12)
    node = first
    while not isinstance(node, Block):
        node = node.body
    assert node.unrolls == (("h", 11), ("k", 2))


def test_r_takes_the_remaining_count():
    spec = ConvSpec(2, 32, 8, 6, 6, 1, 1)
    tree = lower(Scheme.parse("[R n; R h; R w; T8 c; U2 k; V k]"), spec)
    assert [tree.count, tree.body.count, tree.body.body.count] == [2, 6, 6]


@pytest.mark.parametrize("text, message", [
    ("T16 k; V k", "between brackets"),
    ("[T16 k;; V k]", "empty specifier"),
    ("[T16 q; V k]", "unknown dimension"),
    ("[X3 k; V k]", "cannot parse"),
    ("[T16 k]", "exactly one vector"),
    ("[V k; T16 k]", "exactly one vector"),
    ("[T2 h; V h]", "only k can be vectorized"),
    ("[V k; V k]", "exactly one vector"),
    ("[U2 h; T4 c; V k]", "innermost"),
    ("[R h; R h; V k]", "appears twice"),
    ("[Lseq h [(2,11)]; U beta h; V k]", "at least two"),
    ("[Lseq h [(2,11),(1,12)]; T4 c; V k]", "binds no parameter"),
    ("[T4 c; U beta h; V k]", "not bound"),
    ("[PT4 c; V k]", "reduction dimension"),
    ("[PT4 h; T2 k; PT2 w; V k]", "consecutive"),
    ("[Lseq h [(1,2),(1,3)]; PT2 w; U beta h; V k]", "above every Lseq"),
    ("[PU2 h; V k]", "cannot be parallel"),
    ("[T0 h; V k]", "must be >= 1"),
    ("[Lseq h [(2,11), 1]; U beta h; V k]", "list like"),
])
def test_structural_errors_are_named(text, message):
    with pytest.raises(SchemeError, match=message):
        Scheme.parse(text)


@pytest.mark.parametrize("text, message", [
    ("[T2 k; T34 h; T34 w; T3 r; T3 s; T256 c; V k]", "covers 32 along k"),
    ("[T16 k; T34 w; T3 r; T3 s; T256 c; U5 h; U2 k; V k]", "covers 5 along h"),
    ("[T16 k; R h; T34 w; T3 r; T3 s; T256 c; U5 h; U2 k; V k]", "does not divide"),
    ("[T16 k; Lseq h [(2,11),(1,12)]; T34 w; T3 r; T3 s; T256 c; T beta h; U2 c; U2 k; V k]",
     "covers 512 along c"),
    ("[T16 k; T34 h; T34 w; T3 r; T3 s; T256 c; U2 k; V k]", "covers 1 along n, the problem needs 2"),
])
def test_coverage_errors_are_named(text, message):
    spec = ConvSpec(1, 512, 256, 34, 34, 3, 3, pad_top=1, pad_bottom=1, pad_left=1,
                    pad_right=1)
    if "along n," in message:
        spec = ConvSpec(2, 512, 256, 34, 34, 3, 3, pad_top=1, pad_bottom=1, pad_left=1,
                        pad_right=1)
    with pytest.raises(SchemeError, match=message):
        Scheme.parse(text).validate(spec)


def test_register_budget_counts_accumulators_weights_and_broadcast():
    spec = ConvSpec(1, 32, 4, 14, 14, 1, 1)
    Scheme.parse("[T14 w; T4 c; U14 h; U2 k; V k]").validate(spec)  # 28 + 2 + 1 = 31
    spec = ConvSpec(1, 32, 4, 15, 15, 1, 1)
    with pytest.raises(SchemeError, match="needs 33 vector registers"):
        Scheme.parse("[T15 w; T4 c; U15 h; U2 k; V k]").validate(spec)  # 30 + 2 + 1
    with pytest.raises(SchemeError, match="needs 63 vector registers"):  # U on h repeats
        Scheme.parse("[T3 w; T4 c; U3 h; U5 w; U2 h; U2 k; V k]").validate(
            ConvSpec(1, 32, 4, 6, 15, 1, 1))  # (3*2) h * 5 w * 2 k = 60, + 2 + 1


specifier_texts = st.one_of(
    st.builds(lambda p, d: f"{p}R {d}", st.sampled_from(["", "P"]), st.sampled_from("nkhw")),
    st.builds(lambda k, n, d: f"{k}{n} {d}", st.sampled_from(["T", "U"]), st.integers(1, 99),
              st.sampled_from("nkchwrs")),
)


@given(st.lists(specifier_texts, max_size=8))
def test_any_text_either_round_trips_or_is_refused_with_scheme_error(items):
    text = "[" + "; ".join(items + ["V k"]) + "]"
    try:
        scheme = Scheme.parse(text)
    except SchemeError:
        return
    assert Scheme.parse(str(scheme)) == scheme
    assert str(scheme) == text
