"""data/image_clusters.py: k-means clusters of pooled image features as balance entries."""

import numpy as np
import pytest

import data.image_clusters as clusters
from data.balance import ConceptTable, SpreadBalance, TemperatureBalance, balance_factors, build_concept_table
from data.concepts import default_extractor
from data.image_clusters import cluster_table, default_clusters, join_tables, kmeans, pooled_features


def blobs(sizes, seed=0):
    """Points around well-separated centres, `sizes[j]` of blob j, shuffled; (points, blob of each)."""
    rng = np.random.default_rng(seed)
    blob = rng.permutation(np.repeat(np.arange(len(sizes)), sizes))
    return 10.0 * np.eye(len(sizes), 4)[blob] + rng.normal(scale=0.3, size=(len(blob), 4)), blob


def same_partition(a, b):
    return len(set(zip(a.tolist(), b.tolist()))) == len(set(a.tolist())) == len(set(b.tolist()))


def test_kmeans_finds_separated_blobs_of_any_size_and_repeats_itself():
    x, blob = blobs([300, 40, 8])
    labels = kmeans(x, 3, seed=1)
    assert same_partition(labels, blob) and set(labels.tolist()) == {0, 1, 2}
    assert np.array_equal(kmeans(x, 3, seed=1), labels)


def test_assignment_in_blocks_of_rows_equals_the_whole(monkeypatch):
    x, _ = blobs([50, 30, 20], seed=2)
    whole = kmeans(x, 5, seed=0)
    monkeypatch.setattr(clusters, "ROWS_AT_ONCE", 7)
    assert np.array_equal(kmeans(x, 5, seed=0), whole)


def test_a_large_set_is_fit_on_a_subsample_and_every_sample_goes_to_its_nearest_centre(monkeypatch):
    x, blob = blobs([500, 200, 60], seed=3)
    monkeypatch.setattr(clusters, "FIT_ROWS", 100)
    labels = kmeans(x, 3, seed=0)
    assert same_partition(labels, blob) and np.array_equal(kmeans(x, 3, seed=0), labels)


def test_identical_rows_share_a_cluster_even_with_more_clusters_than_distinct_rows_and_bad_k_is_refused():
    x = np.repeat(np.arange(3.0)[:, None], 4, axis=0)  # 12 rows, 3 distinct
    labels = kmeans(x, 5, seed=0)
    assert labels.min() >= 0 and labels.max() < 5 and same_partition(labels, x[:, 0].astype(int))
    for k in (0, 13):
        with pytest.raises(ValueError, match="1 <= k <= the 12 samples"):
            kmeans(x, k)
    assert default_clusters(8192) == 91 and default_clusters(1) == 1


def test_pooled_features_average_each_channel_over_the_grid():
    images = np.arange(2 * 3 * 4 * 8, dtype=np.float32).reshape(2, 3, 4, 8)
    features = pooled_features(images, (2, 4))
    assert features.shape == (2, 3 * 2 * 4) and features.dtype == np.float64
    assert features[1, 0] == images[1, 0, :2, :2].mean() and features[0, -1] == images[0, 2, 2:, 6:].mean()
    with pytest.raises(ValueError, match="a 4 x 8 image does not split into a 3 x 4 grid"):
        pooled_features(images, (3, 4))


def test_a_rare_cluster_is_drawn_like_a_rare_concept_and_joined_entries_take_the_rarest():
    _, blob = blobs([60, 30, 10])
    table = cluster_table(blob)
    assert table.entries == ["image:0", "image:1", "image:2"] and table.lengths().tolist() == [1] * 100
    draws = balance_factors(table, TemperatureBalance(1.0))
    totals = [draws[blob == j].sum() for j in range(3)]
    assert max(totals) / min(totals) == pytest.approx(1.0)  # alpha 1: each cluster drawn equally often in total
    rule = SpreadBalance(0.9)
    balance_factors(table, rule)
    assert 0 < rule.alpha < 1
    captions = ["a red circle" if i % 2 else "a cyan ring" for i in range(100)]
    words = build_concept_table(captions, default_extractor())
    both = join_tables(words, table)
    assert both.entries == words.entries + table.entries
    assert [both.sample_entries(i) for i in range(100)] == [words.sample_entries(i) + table.sample_entries(i)
                                                            for i in range(100)]
    rarest = balance_factors(both, TemperatureBalance(1.0))
    assert rarest[blob == 2].min() > rarest[blob == 0].max()  # the rare cluster is the rarest entry of its samples
    gaps = ConceptTable(["x"], np.array([0, 0, 1, 1]), np.array([0], dtype=np.int32))  # samples without entries
    assert [join_tables(gaps, cluster_table(np.array([2, 2, 1]))).sample_entries(i) for i in range(3)] == [
        ["image:2"], ["x", "image:2"], ["image:1"]]
    with pytest.raises(ValueError, match="the tables cover 100 and 3 samples"):
        join_tables(words, cluster_table(np.array([0, 1, 0])))
