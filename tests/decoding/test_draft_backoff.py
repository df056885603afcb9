"""Prompt-lookup drafts adapt their length and back off after rejected drafts
(runtime.engine.drafts)."""

from __future__ import annotations

from runtime.engine.drafts import MAX_BACKOFF, Drafter


def _drafter() -> Drafter:
    # "1 2 3 4 1 2 3" ends with an n-gram seen before: the lookup proposes "4 1 2 3".
    return Drafter([1, 2, 3, 4, 1, 2, 3], prompt_lookup=4)


def _pauses(d: Drafter) -> int:
    """Decode steps until the next lookup draft (the draft is judged rejected)."""
    n = 0
    while not d.propose(None, 4):
        n += 1
    d.judged(0)
    return n


def test_rejected_drafts_pause_lookups_doubling_up_to_the_cap() -> None:
    d = _drafter()
    assert d.propose(None, 4) == [4, 1, 2, 3]
    d.judged(0)
    assert [_pauses(d) for _ in range(7)] == [1, 2, 4, 8, 16, MAX_BACKOFF, MAX_BACKOFF]


def test_a_kept_token_resets_the_backoff() -> None:
    d = _drafter()
    d.propose(None, 4)
    d.judged(0)
    assert _pauses(d) == 1  # judged(0) inside: the second miss in a row
    assert _pauses(d) == 2
    assert d.propose(None, 4) == []  # paused
    assert d.propose(None, 4) == []
    assert d.propose(None, 4) == []
    assert d.propose(None, 4) == []
    assert d.propose(None, 4)
    d.judged(1)  # one token kept: lookups go on every step
    assert d.propose(None, 4)


def test_reset_forgets_the_backoff_so_a_replay_decides_alike() -> None:
    d = _drafter()
    d.propose(None, 4)
    d.judged(0)
    d.reset()
    assert d.propose(None, 4) == [4, 1, 2, 3]


def test_an_unjudged_or_empty_proposal_does_not_count() -> None:
    d = Drafter([5, 6, 7], prompt_lookup=4)  # no repeated n-gram: nothing to propose
    assert d.propose(None, 4) == []
    d.judged(0)  # nothing was looked up: no pause
    d.accept(5)
    d.accept(6)
    d.accept(7)
    assert d.propose(None, 4) == [5, 6, 7]


def test_the_length_follows_what_was_kept() -> None:
    d = Drafter([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3], prompt_lookup=8)
    assert d.propose(None, 8) == [4, 5, 6, 7, 8, 9, 1, 2]  # the full length first
    d.judged(2)  # two kept: the next draft proposes one more than that
    assert d.propose(None, 8) == [4, 5, 6]
    d.judged(3)  # kept whole: the length doubles
    assert d.propose(None, 8) == [4, 5, 6, 7, 8, 9]
    d.judged(6)
    assert d.propose(None, 8) == [4, 5, 6, 7, 8, 9, 1, 2]  # doubled, up to prompt_lookup
    assert d.propose(None, 3) == [4, 5, 6]  # the step's own limit still caps it


def test_only_three_token_matches_propose_by_default() -> None:
    # "... 7 8 9 1 2" ends with "1 2" (and "2"), seen before, but no 3-token match
    history = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    assert Drafter(history, prompt_lookup=8).propose(None, 8) == []
    assert Drafter(history, prompt_lookup=8, min_ngram=2).propose(None, 8) == [3, 4, 5, 6, 7,
                                                                             8, 9, 1]
    assert Drafter(history, prompt_lookup=8, min_ngram=1).propose(None, 8) == [3, 4, 5, 6, 7,
                                                                             8, 9, 1]


def test_a_rejected_draft_restarts_from_one_token() -> None:
    d = _drafter()
    d.propose(None, 4)
    d.judged(0)
    assert _pauses(d) == 1  # the draft after the pause has one token
    d.reset()
    assert d.propose(None, 4) == [4, 1, 2, 3]  # reset: the full length again
    d.judged(0)
    assert d.propose(None, 4) == []  # paused one step
    assert d.propose(None, 4) == [4]
    d.judged(1)
    assert d.propose(None, 4) == [4, 1]
