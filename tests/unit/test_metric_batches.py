"""observe_many records what one observe() per value records."""

import random

from prometheus_client import CollectorRegistry, Histogram

from afd.metric_batches import observe_many

BUCKETS = (0.001, 0.01, 0.1, 1.0, 10.0)


def _samples(hist: Histogram) -> dict[tuple[str, str], float]:
    (family,) = hist.collect()
    return {
        (s.name, s.labels.get("le", "")): s.value
        for s in family.samples
        if "_created" not in s.name
    }


def _pair() -> tuple[Histogram, Histogram]:
    made = [Histogram("h", "test", buckets=BUCKETS, registry=CollectorRegistry()) for _ in range(2)]
    return made[0], made[1]


def test_same_buckets_count_and_sum_as_observe():
    rng = random.Random(0)
    # values on the bounds themselves (a bound's bucket is "<= bound"), between and past them
    values = [b for b in BUCKETS for _ in range(3)] + [rng.uniform(0, 20) for _ in range(500)]
    values += [0.0, -1.0, 1e9]
    rng.shuffle(values)
    one, many = _pair()
    for v in values:
        one.observe(v)
    observe_many(many, values)
    assert _samples(many) == _samples(one)


def test_integers_and_an_empty_batch():
    one, many = _pair()
    for v in [1, 1, 4, 0, 10, 11]:
        one.observe(v)
    observe_many(many, [1, 1, 4, 0, 10, 11])
    observe_many(many, [])
    assert _samples(many) == _samples(one)


def test_falls_back_to_observe_without_the_internals():
    seen = []

    class Plain:
        def observe(self, v):
            seen.append(v)

    observe_many(Plain(), [0.5, 2.0])
    assert seen == [0.5, 2.0]
