"""The scheduler without a model (admission, chunking, ragged positions, ids, exact token counts),
then batched greedy decoding on `tiny` against `Engine.generate`, prompt by prompt."""

import pytest

from engine import flags
from engine import scheduler as scheduler_module
from engine.runtime import Engine
from engine.scheduler import DECODE, PREFILL, Batch, Row, Scheduler
from engine.sequence import Sequence


def drive(scheduler, sequences, token=lambda batch, row: 7):
    """Run the scheduler to completion with a fake model; return the batches it made."""
    for sequence in sequences:
        scheduler.add(sequence, now=0.0)
    batches = []
    while scheduler.has_work():
        batch = scheduler.schedule(now=float(len(batches)))
        assert len(scheduler.running) <= scheduler.max_slots
        batches.append(batch)
        scheduler.postprocess(batch, [token(batch, row) for row in batch.rows], now=len(batches) - 0.5)
    return batches


def test_admission_respects_the_token_budget_and_the_chunk():
    scheduler = Scheduler(max_slots=8, capacity=64, token_budget=32, prefill_chunk=16)
    sequences = [Sequence(range(20), 2) for _ in range(5)]
    batches = drive(scheduler, sequences)
    first = batches[0]
    assert first.phase == PREFILL
    assert [(row.sequence, row.start, len(row.tokens)) for row in first.rows] == [
        (sequences[0], 0, 16), (sequences[1], 0, 16)]  # budget spent: the other three wait
    second = batches[1]  # admitted sequences continue first, then new ones fill the budget
    assert [(row.sequence, row.start, len(row.tokens)) for row in second.rows] == [
        (sequences[0], 16, 4), (sequences[1], 16, 4), (sequences[2], 0, 16), (sequences[3], 0, 8)]
    for batch in batches:
        assert batch.n_tokens <= 32
        assert all(len(row.tokens) <= 16 for row in batch.rows)
        assert batch.phase in (PREFILL, DECODE)


def test_a_long_prompt_is_prefilled_in_chunk_pieces_and_emits_once():
    scheduler = Scheduler(max_slots=1, capacity=64, token_budget=16, prefill_chunk=16)
    sequence = Sequence(range(40), 3)
    batches = drive(scheduler, [sequence])
    prefill = [batch.rows[0] for batch in batches if batch.phase == PREFILL]
    assert [(row.start, len(row.tokens), row.emits) for row in prefill] == [(0, 16, False), (16, 16, False),
                                                                              (32, 8, True)]
    assert [tuple(row.tokens) for row in prefill] == [tuple(range(0, 16)), tuple(range(16, 32)), tuple(range(32, 40))]
    decode = [batch.rows[0] for batch in batches if batch.phase == DECODE]
    assert [row.start for row in decode] == [40, 41]  # the last generated token is never fed back


def test_decode_rows_are_ragged_each_at_its_own_position():
    scheduler = Scheduler(max_slots=3, capacity=64, token_budget=64, prefill_chunk=16)
    sequences = [Sequence(range(5), 4), Sequence(range(11), 4), Sequence(range(2), 4)]
    batches = drive(scheduler, sequences, token=lambda batch, row: 100 + batch.step)
    decodes = [batch for batch in batches if batch.phase == DECODE]
    assert [row.start for row in decodes[0].rows] == [5, 11, 2]
    assert [row.start for row in decodes[1].rows] == [6, 12, 3]
    assert decodes[0].key_length == 12 and decodes[0].width == 1
    # each decode row feeds the token its sequence received last
    assert [row.tokens for row in decodes[1].rows] == [(100 + decodes[0].step,)] * 3


def test_every_sequence_finishes_with_exactly_the_asked_tokens_and_slots_are_reused():
    scheduler = Scheduler(max_slots=2, capacity=64, token_budget=32, prefill_chunk=16)
    asked = [1, 5, 3, 8, 2, 6]
    sequences = [Sequence(range(3 + 7 * index), count) for index, count in enumerate(asked)]
    batches = drive(scheduler, sequences)
    assert [len(sequence.generated) for sequence in sequences] == asked
    assert all(sequence.finished and sequence.finished_at is not None for sequence in sequences)
    assert scheduler.free_slots == [0, 1] and not scheduler.running
    used = {row.sequence.slot for batch in batches for row in batch.rows}
    assert used == {0, 1}
    for batch in batches:  # one row per sequence per step, never two sequences in one slot
        assert len({row.sequence.request_id for row in batch.rows}) == len(batch.rows)
        assert len(set(batch.slots)) == len(batch.slots)


def test_a_request_finishing_inside_its_first_step_is_stamped_before_it():
    scheduler = Scheduler(max_slots=4, capacity=64, token_budget=64, prefill_chunk=16)
    sequence = Sequence(range(10), 1)
    scheduler.add(sequence, now=1.0)
    batch = scheduler.schedule(now=2.0)
    scheduler.postprocess(batch, [9], now=3.0)
    assert (sequence.arrived_at, sequence.first_scheduled_at, sequence.first_token_at, sequence.finished_at) == (
        1.0, 2.0, 3.0, 3.0)


def test_request_ids_are_distinct_across_requests_and_repetitions():
    first = [Sequence((1, 2), 1) for _ in range(4)]
    second = [Sequence((1, 2), 1) for _ in range(4)]  # a repetition of the same requests
    ids = [sequence.request_id for sequence in first + second]
    assert len(set(ids)) == len(ids)


class FromScratch(Scheduler):
    """The scheduler without its steady-cohort fast path: every step decided from scratch."""

    def schedule(self, now=None):
        self._cohort = None
        return super().schedule(now)


def _steps(batches, sequences):
    index = {id(sequence): position for position, sequence in enumerate(sequences)}
    return [(batch.step, batch.phase, [(index[id(row.sequence)], row.sequence.slot, row.start, row.tokens, row.emits)
                                       for row in batch.rows]) for batch in batches]


@pytest.mark.parametrize("slots, budget, prompts, asked", [
    (1, 16, [5], [6]),  # one sequence: prefill, then a steady cohort to the end
    (3, 64, [5, 11, 2], [4, 6, 5]),  # ragged decode rows; the cohort shrinks as sequences finish
    (2, 32, [3 + 7 * index for index in range(6)], [1, 5, 3, 8, 2, 6]),  # waiting sequences take freed slots
    (4, 32, [40, 3, 17], [3, 9, 2]),  # chunked prefill beside finished prompts
])
def test_the_steady_cohort_fast_path_schedules_what_deciding_from_scratch_does(slots, budget, prompts, asked,
                                                                               monkeypatch):
    fast, built = [], scheduler_module._decode_batch
    monkeypatch.setattr(scheduler_module, "_decode_batch", lambda step, rows: fast.append(step) or built(step, rows))
    runs = []
    for kind in (Scheduler, FromScratch):
        sequences = [Sequence(range(length), count) for length, count in zip(prompts, asked)]
        batches = drive(kind(max_slots=slots, capacity=64, token_budget=budget, prefill_chunk=16), sequences,
                        token=lambda batch, row: 100 + batch.step)
        runs.append((_steps(batches, sequences), [(sequence.generated, sequence.first_scheduled_at,
                                                   sequence.first_token_at, sequence.finished_at)
                                                  for sequence in sequences]))
    assert runs[0] == runs[1]
    assert fast and all(runs[0][0][step][1] == DECODE for step in fast)  # the fast path ran, in the first run only


def test_a_steady_cohort_takes_a_sequence_added_mid_run_and_its_batches_equal_built_ones():
    scheduler = Scheduler(max_slots=2, capacity=64, token_budget=32, prefill_chunk=16)
    first = Sequence(range(4), 6)
    scheduler.add(first, now=0.0)
    batches = []
    for step in range(3):  # a prefill, then decode steps: the cohort is steady from the first decode on
        batches.append(scheduler.schedule(now=float(step)))
        scheduler.postprocess(batches[-1], [7], now=step + 0.5)
    assert [batch.phase for batch in batches] == [PREFILL, DECODE, DECODE] and scheduler._cohort == (first,)
    steady = batches[-1]
    assert type(steady) is Batch and all(type(row) is Row for row in steady.rows)
    assert steady == Batch(steady.step, DECODE, (Row(first, first.cached - 1, (7,), True),))
    second = Sequence(range(3), 2)
    scheduler.add(second, now=3.0)  # a free slot: admitted (prefilled) at the next step
    admitted = scheduler.schedule(now=4.0)
    assert admitted.phase == PREFILL and [row.sequence for row in admitted.rows] == [second]
    scheduler.postprocess(admitted, [8], now=4.5)
    both = scheduler.schedule(now=5.0)
    assert both.phase == DECODE and [row.sequence for row in both.rows] == [first, second]
    assert second.first_scheduled_at == 4.0


def test_a_sequence_first_run_without_a_time_is_stamped_at_its_first_timed_step():
    scheduler = Scheduler(max_slots=1, capacity=64, token_budget=16, prefill_chunk=16)
    sequence = Sequence(range(4), 4)
    scheduler.add(sequence)
    scheduler.postprocess(scheduler.schedule(), [1])  # no time given: nothing stamped
    assert sequence.first_scheduled_at is None
    scheduler.postprocess(scheduler.schedule(now=2.0), [1], now=2.5)
    scheduler.schedule(now=3.0)
    assert sequence.first_scheduled_at == 2.0


@pytest.mark.parametrize("arguments, fragment", [
    (dict(max_slots=0, capacity=8, token_budget=32, prefill_chunk=16), "max_slots"),
    (dict(max_slots=1, capacity=8, token_budget=32, prefill_chunk=8), "prefill_chunk must be >= 16"),
    (dict(max_slots=1, capacity=8, token_budget=16, prefill_chunk=32), "token_budget"),
])
def test_bad_scheduler_settings(arguments, fragment):
    with pytest.raises(ValueError, match=fragment):
        Scheduler(**arguments)


def test_a_request_larger_than_a_slot_is_refused_and_a_sequence_cannot_run_twice():
    scheduler = Scheduler(max_slots=1, capacity=10, token_budget=16, prefill_chunk=16)
    with pytest.raises(ValueError, match="needs 12 cache positions"):
        scheduler.add(Sequence(range(8), 5))
    sequence = Sequence(range(4), 2)
    drive(scheduler, [sequence])
    with pytest.raises(ValueError, match="already run"):
        scheduler.add(sequence)


# --------------------------------------------------------------------------------------------
# Batched greedy decoding on tiny equals single-sequence generate
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    return Engine.load("tiny", "cpu", seed=0)


PROMPTS = [
    list(b"hello experts"),  # 13 tokens: one chunk
    list(b"abc"),  # 3 tokens: shorter than everyone, ragged prefill row
    list(b"The fused path must honour the composite mask." * 2),  # 94 tokens: six chunks of 16
    list(b"xyzw" * 5),  # 20 tokens: admitted late (only 3 slots), into a reused slot
]
ASKED = [5, 7, 4, 6]


def test_batched_greedy_tokens_equal_generate_for_each_prompt(tiny):
    resolved = flags.resolve(["prefill_chunk=16"], environ={})
    batched = tiny.generate_batch(PROMPTS, ASKED, resolved, max_slots=3, token_budget=32)
    for prompt, count, sequence in zip(PROMPTS, ASKED, batched.sequences):
        assert sequence.generated == tiny.generate(prompt, count, resolved).tokens, sequence.request_id
    phases = {step["phase"] for step in batched.steps}
    assert phases == {"prefill", "decode", "mixed"}  # the third prompt is admitted while two decode
    # ragged steps happened: a prefill step with rows of different lengths and starts, and a decode
    # step with rows at different positions
    assert any(len({row["tokens"] for row in step["rows"]}) > 1 for step in batched.steps if step["phase"] == "prefill")
    assert any(len({row["start"] for row in step["rows"]}) > 1 for step in batched.steps if step["phase"] == "decode")
    # a slot was reused by the late request
    late = batched.sequences[3]
    assert late.slot in {sequence.slot for sequence in batched.sequences[:3]}


def test_batched_steps_record_one_decision_per_layer_whatever_the_batch(tiny):
    resolved = flags.resolve(["prefill_chunk=16"], environ={})
    batched = tiny.generate_batch(PROMPTS[:2], 3, resolved)
    layers = tiny.config.n_layers
    for step in batched.steps:
        assert [record["layer"] for record in step["moe"]] == list(range(layers))
        assert [record["layer"] for record in step["attention"]] == list(range(layers))
        assert step["n_tokens"] == sum(row["tokens"] for row in step["rows"])
        for record in step["moe"] + step["attention"]:
            assert record["n_tokens"] == step["n_tokens"] and record["phase"] == step["phase"]
        assert step["started"] <= step["ended"]
    assert batched.counters["arms"]["reference"] == layers * len(batched.steps)
    first_ids = [sequence.request_id for sequence in batched.sequences]
    again = tiny.generate_batch(PROMPTS[:2], 3, resolved)
    assert again.tokens == batched.tokens
    assert not set(first_ids) & {sequence.request_id for sequence in again.sequences}


def _steady(scheduler, sequences):
    """Schedule and postprocess until the scheduler hands out a steady decode cohort; return its step."""
    for sequence in sequences:
        scheduler.add(sequence, now=0.0)
    while True:
        batch = scheduler.schedule(now=0.0)
        if scheduler._cohort is not None:
            return batch
        scheduler.postprocess(batch, [7] * len(batch.rows), now=0.0)


def test_reserve_next_only_when_the_next_step_is_certain():
    scheduler = Scheduler(max_slots=2, capacity=64, token_budget=32, prefill_chunk=16)
    sequences = [Sequence(range(4), 4), Sequence(range(4), 6)]
    batch = _steady(scheduler, sequences)  # generated 1 each: this step makes 2
    assert batch.phase == DECODE and scheduler.reserve_next(batch)
    assert scheduler.reserve_next(batch)  # again: the same reservation, not a second step
    assert not scheduler.reserve_next(batch, 3)  # sequence 0 finishes before the third step after this one
    scheduler.postprocess(batch, [7, 7], now=1.0)
    reserved = scheduler.schedule(now=2.0)  # generated 2: this step makes 3, the next the 4th (the last)
    assert [row.sequence for row in reserved.rows] == sequences and reserved.step == batch.step + 1
    assert scheduler.reserve_next(reserved)  # the next step is sequence 0's last: still the same cohort
    scheduler.postprocess(reserved, [7, 7], now=3.0)
    last = scheduler.schedule(now=4.0)
    assert not scheduler.reserve_next(last)  # sequence 0 finishes at this step: the cohort changes after it
    scheduler.postprocess(last, [7, 7], now=5.0)
    assert sequences[0].finished and len(sequences[0].generated) == 4


def test_reserve_next_never_while_a_sequence_waits_and_a_reservation_binds():
    scheduler = Scheduler(max_slots=1, capacity=64, token_budget=32, prefill_chunk=16)
    first, second = Sequence(range(4), 6), Sequence(range(4), 6)
    batch = _steady(scheduler, [first, second])  # the second waits for the one slot
    assert scheduler.waiting and not scheduler.reserve_next(batch)
    scheduler = Scheduler(max_slots=2, capacity=64, token_budget=32, prefill_chunk=16)
    batch = _steady(scheduler, [first := Sequence(range(4), 6)])
    assert scheduler.reserve_next(batch)
    scheduler.postprocess(batch, [7], now=1.0)
    late = Sequence(range(4), 3)
    scheduler.add(late, now=1.5)  # after the next step was launched: it waits one step
    assert [row.sequence for row in scheduler.schedule(now=2.0).rows] == [first]
    assert scheduler.schedule(now=3.0).phase == PREFILL


def test_reserve_next_refuses_a_step_past_the_slot_capacity():
    scheduler = Scheduler(max_slots=1, capacity=8, token_budget=32, prefill_chunk=16)
    batch = _steady(scheduler, [Sequence(range(4), 5)])  # capacity 8 = 4 + 5 - 1: exactly enough
    sequence = batch.rows[0].sequence
    sequence.max_tokens = 99  # broken from outside: only the capacity check stands between it and a bad write
    while sequence.cached + 1 < scheduler.capacity:  # the next step writes position cached + 1
        assert scheduler.reserve_next(batch)
        scheduler.postprocess(batch, [7], now=0.0)
        batch = scheduler.schedule(now=0.0)
    assert batch.rows[0].start == scheduler.capacity - 1 and not scheduler.reserve_next(batch)


def test_reserve_several_steps_returns_them_in_order_and_extends_while_standing():
    scheduler = Scheduler(max_slots=3, capacity=64, token_budget=32, prefill_chunk=16)
    sequences = [Sequence(range(4), 9), Sequence(range(4), 12)]
    batch = _steady(scheduler, sequences)  # generated 1 each: this step makes 2
    assert not scheduler.reserve_next(batch, 8)  # sequence 0's 9th token is its last: 2 + 8 > 9
    assert scheduler.reserve_next(batch, 3)  # steps +1..+3: the 3rd, 4th and 5th tokens
    late = Sequence(range(4), 3)
    scheduler.add(late, now=0.5)  # waits until the reservation is spent
    scheduler.postprocess(batch, [7, 7], now=1.0)
    first = scheduler.schedule(now=1.0)
    assert first.phase == DECODE and first.step == batch.step + 1 and [r.start for r in first.rows] == [5, 5]
    assert not scheduler.reserve_next(first, 4)  # someone waits: no extension
    for step in (2, 3):
        scheduler.postprocess(first, [7, 7], now=1.0)
        first = scheduler.schedule(now=1.0)
        assert first.phase == DECODE and first.step == batch.step + step
    scheduler.postprocess(first, [7, 7], now=1.0)
    assert scheduler.schedule(now=2.0).phase == PREFILL  # the reservation spent: the waiting one is admitted


def test_a_standing_reservation_is_extended_never_shortened():
    scheduler = Scheduler(max_slots=1, capacity=64, token_budget=32, prefill_chunk=16)
    batch = _steady(scheduler, [Sequence(range(4), 20)])
    assert scheduler.reserve_next(batch, 3)
    scheduler.postprocess(batch, [7], now=0.0)
    batch = scheduler.schedule(now=0.0)  # the first of the three
    assert scheduler.reserve_next(batch, 1)  # inside the standing reservation: through stays 3 steps on
    assert scheduler._reserved_through == batch.step + 2
    assert scheduler.reserve_next(batch, 5)  # a graph of several steps launched ahead: extended
    assert scheduler._reserved_through == batch.step + 5
    with pytest.raises(ValueError, match="steps"):
        scheduler.reserve_next(batch, 0)


def test_reserve_several_steps_refuses_past_the_slot_capacity():
    scheduler = Scheduler(max_slots=1, capacity=8, token_budget=32, prefill_chunk=16)
    batch = _steady(scheduler, [Sequence(range(4), 5)])  # capacity 8 = 4 + 5 - 1; this step writes position 4
    batch.rows[0].sequence.max_tokens = 99  # broken from outside: only the capacity check stands
    assert not scheduler.reserve_next(batch, 4)  # would write position 8
    assert scheduler.reserve_next(batch, 3)  # the last writes position 7


def test_a_sequence_finishing_under_a_reservation_is_an_error():
    scheduler = Scheduler(max_slots=1, capacity=64, token_budget=32, prefill_chunk=16)
    batch = _steady(scheduler, [Sequence(range(4), 6)])
    assert scheduler.reserve_next(batch)
    batch.rows[0].sequence.max_tokens = 2  # broken from outside: this step now makes the last token
    with pytest.raises(RuntimeError, match="reserved"):
        scheduler.postprocess(batch, [7], now=0.0)


def _state(scheduler, sequences):
    return ([(s.cached, list(s.generated), list(s.token_times), s.first_token_at, s.status, s.finished_at, s.slot)
             for s in sequences], scheduler.steps, scheduler._reserved is not None, list(scheduler.free_slots),
            [sequences.index(sequence) for sequence in scheduler.running])


def test_serve_reserved_does_what_schedule_then_postprocess_do():
    """Two schedulers in the same state, one stepping reserved steps by schedule + postprocess, the other by
    serve_reserved: the same sequences (positions, tokens, stamps, the last step's finish) and scheduler state,
    through the reservation's end (the second sequence's last token is the last reserved step's)."""
    runs = []
    for serve in (False, True):
        scheduler = Scheduler(max_slots=2, capacity=64, token_budget=32, prefill_chunk=16)
        sequences = [Sequence(range(4), 9), Sequence(range(5), 6)]
        batch = _steady(scheduler, sequences)  # generated 1 each: this step makes the 2nd
        assert scheduler.reserve_next(batch, 4)  # the 3rd..6th: the second sequence's last is the 4th step's
        scheduler.postprocess(batch, [11, 12], now=1.0)
        for step in range(batch.step + 1, batch.step + 5):
            tokens = [step, 100 + step, 999]  # run on past the rows, as a landing row's woken counts do
            if serve:
                assert scheduler.serve_reserved(step, tokens, now=float(step)) == tuple(sequences)
            else:
                reserved = scheduler.schedule(now=float(step))
                assert reserved.step == step and [row.sequence for row in reserved.rows] == sequences
                scheduler.postprocess(reserved, tokens[:2], now=float(step))
        runs.append(_state(scheduler, sequences))
        assert sequences[1].finished and not sequences[0].finished
    assert runs[0] == runs[1]


def test_serve_reserved_refuses_a_step_that_is_not_the_next_reserved_one():
    scheduler = Scheduler(max_slots=1, capacity=64, token_budget=32, prefill_chunk=16)
    batch = _steady(scheduler, [sequence := Sequence(range(4), 20)])
    with pytest.raises(RuntimeError, match="not the next reserved step"):
        scheduler.serve_reserved(batch.step + 1, [7], now=0.0)  # nothing reserved
    assert scheduler.reserve_next(batch, 2)
    scheduler.postprocess(batch, [7], now=0.0)
    with pytest.raises(RuntimeError, match="not the next reserved step"):
        scheduler.serve_reserved(batch.step + 2, [7], now=0.0)  # skips a step
    scheduler.serve_reserved(batch.step + 1, [7], now=0.0)
    scheduler.serve_reserved(batch.step + 2, [7], now=0.0)  # the last reserved: the reservation is spent
    with pytest.raises(RuntimeError, match="not the next reserved step"):
        scheduler.serve_reserved(batch.step + 3, [7], now=0.0)
    assert len(sequence.generated) == 4 and sequence.cached == 4 + 3


def test_serve_reserved_refuses_a_sequence_finishing_before_the_reservation_ends():
    scheduler = Scheduler(max_slots=1, capacity=64, token_budget=32, prefill_chunk=16)
    batch = _steady(scheduler, [sequence := Sequence(range(4), 9)])
    assert scheduler.reserve_next(batch, 3)
    scheduler.postprocess(batch, [7], now=0.0)
    sequence.max_tokens = 3  # broken from outside: the first reserved step now makes the last token
    with pytest.raises(RuntimeError, match="reserved"):
        scheduler.serve_reserved(batch.step + 1, [7], now=0.0)


# ------------------------------------------------------------------------------------------------
# Mixed steps: decoders keep decoding while a sequence is admitted
# ------------------------------------------------------------------------------------------------

def _run_to_decoding(scheduler, sequence):
    batch = scheduler.schedule(0.0)
    scheduler.postprocess(batch, [7] * len(batch.rows), 0.0)
    return batch


def test_a_prefill_step_carries_the_decoders_tokens_first_when_mixed():
    scheduler = Scheduler(4, 64, 24, 16, mixed=True)
    first = Sequence(tuple(range(1, 6)), 8)
    scheduler.add(first, 0.0)
    _run_to_decoding(scheduler, first)  # prefilled: it decodes from now on
    later = Sequence(tuple(range(1, 41)), 4)  # 40 prompt tokens: more than one step's budget
    scheduler.add(later, 0.0)
    batch = scheduler.schedule(0.0)
    assert batch.phase == "mixed"
    assert [(row.sequence, row.start, len(row.tokens), row.emits) for row in batch.rows] == [
        (first, 5, 1, True), (later, 0, 16, False)]
    assert batch.n_tokens == 17  # what the MoE gate sees: every row of the step
    scheduler.postprocess(batch, [9, 0], 0.0)
    assert first.generated == [7, 9] and later.cached == 16 and not later.generated
    batch = scheduler.schedule(0.0)  # the budget (24) holds the decoder and one chunk of 16
    assert batch.phase == "mixed" and [len(row.tokens) for row in batch.rows] == [1, 16]


def test_without_mixed_steps_the_decoders_wait_for_the_prefill():
    scheduler = Scheduler(4, 64, 24, 16, mixed=False)
    first = Sequence(tuple(range(1, 6)), 8)
    scheduler.add(first, 0.0)
    _run_to_decoding(scheduler, first)
    scheduler.add(Sequence(tuple(range(1, 41)), 4), 0.0)
    batch = scheduler.schedule(0.0)
    assert batch.phase == PREFILL and all(row.sequence is not first for row in batch.rows)


def test_mixed_decoders_leave_the_prefill_at_least_one_token():
    scheduler = Scheduler(20, 64, 16, 16, mixed=True)
    decoders = [Sequence((1, 2), 20) for _ in range(18)]
    for sequence in decoders[:16]:
        scheduler.add(sequence, 0.0)
    batch = scheduler.schedule(0.0)  # eight prompts of two tokens: all 16 admitted in one step
    scheduler.postprocess(batch, [3] * len(batch.rows), 0.0)
    for sequence in decoders[16:]:
        scheduler.add(sequence, 0.0)
    batch = scheduler.schedule(0.0)
    assert batch.phase == "mixed" and batch.n_tokens <= 16
    assert sum(1 for row in batch.rows if row.start < len(row.sequence.prompt)) >= 1


def test_mixed_steps_give_the_tokens_of_unmixed_ones(tiny):
    prompts = [list(b"first prompt"), list(b"a second, longer prompt that arrives")]
    results = {}
    for mixed in (True, False):
        resolved = flags.resolve([f"mixed_steps={'on' if mixed else 'off'}", "prefill_chunk=16"], environ={})
        results[mixed] = tiny.generate_batch(prompts, [12, 4], resolved, max_slots=2, token_budget=16)
    assert results[True].tokens == results[False].tokens
    phases = [step["phase"] for step in results[True].steps]
    assert "mixed" in phases and "mixed" not in [step["phase"] for step in results[False].steps]
    mixed = next(step for step in results[True].steps if step["phase"] == "mixed")
    assert all(record["phase"] == "mixed" and record["n_tokens"] == mixed["n_tokens"] for record in mixed["moe"])
    assert len(results[True].steps) < len(results[False].steps)
