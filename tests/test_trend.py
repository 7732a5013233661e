"""labkit.trend: the sentence follows the numbers; reorder them and it changes."""

import pytest

from labkit.trend import describe_trend, fit_polynomial, rank_correlation, ranks, shape_words, trend_shape

MS = [1, 2, 4, 8, 16]
BUBBLE = [0.515, 0.406, 0.316, 0.339, 0.411]  # notebook 06's GPipe bubble on one run: lowest at M = 4


def test_the_measured_bubble_is_lowest_at_4_then_rises():
    assert describe_trend(MS, BUBBLE, x_name="M") == \
        "falls from 0.515 at M = 1 to its lowest, 0.316 at M = 4, then rises to 0.411 at M = 16"


def test_reordering_the_numbers_changes_the_sentence():
    falling = sorted(BUBBLE, reverse=True)
    rising = sorted(BUBBLE)
    peaked = [0.316, 0.406, 0.515, 0.411, 0.339]
    sentences = {describe_trend(MS, ys, x_name="M") for ys in (BUBBLE, falling, rising, peaked)}
    assert len(sentences) == 4
    assert describe_trend(MS, falling, x_name="M") == "falls from 0.515 at M = 1 to 0.316 at M = 16"
    assert describe_trend(MS, rising, x_name="M") == "rises from 0.316 at M = 1 to 0.515 at M = 16"
    assert describe_trend(MS, peaked, x_name="M").startswith("rises from 0.316 at M = 1 to its highest, 0.515 at M = 4")


@pytest.mark.parametrize("ys, tol, shape", [([1, 1, 1], 0, "flat"), ([1, 2, 3], 0, "rises"), ([3, 2, 1], 0, "falls"),
                                            ([3, 1, 2], 0, "dips"), ([1, 3, 2], 0, "peaks"), ([1, 3, 2, 4], 0, "mixed"),
                                            ([3, 3, 2, 2, 1], 0, "falls"), ([1.0, 1.01, 0.995], 0.02, "flat")])
def test_shapes(ys, tol, shape):
    assert trend_shape(ys, tol=tol) == shape


def test_tolerance_levels_small_steps_and_bad_input_is_refused():
    assert trend_shape([0.30, 0.301, 0.25], tol=0.005) == "falls"
    assert describe_trend([1, 2, 3], [1, 3, 2, 4][:3]).startswith("rises")
    assert "without one direction" in describe_trend([1, 2, 3, 4], [1, 3, 2, 4])
    with pytest.raises(ValueError, match="two values"):
        trend_shape([1.0])
    with pytest.raises(ValueError, match="same length"):
        describe_trend([1, 2], [1.0])


def test_shape_words_follow_the_numbers():
    assert shape_words(BUBBLE) == "falls, then rises"
    assert shape_words(sorted(BUBBLE)) == "rises"
    assert shape_words([0.52, 0.39, 0.50, 0.46, 0.63]) == "moves up and down"
    assert shape_words([0.30, 0.301, 0.302], tol=0.005) == "stays level"


def test_a_level_trend_names_its_value_once_when_the_ends_print_alike():
    assert describe_trend([2, 4], [25.61, 25.64], "{:.1f} MiB", "k", tol=0.1) == "stays level at 25.6 MiB from k = 2 to k = 4"
    assert describe_trend([2, 4], [25.61, 25.69], "{:.1f} MiB", "k", tol=0.1) == \
        "stays level, from 25.6 MiB at k = 2 to 25.7 MiB at k = 4"


def test_ranks_share_ties_and_rank_correlation_is_spearmans():
    assert ranks([30, 10, 20, 20]) == [4.0, 1.0, 2.5, 2.5]
    assert rank_correlation([1, 2, 3, 4], [10, 20, 30, 400]) == pytest.approx(1.0)  # the same order, any spacing
    assert rank_correlation([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # by hand: ranks (1, 2.5, 2.5, 4) and (1, 3, 2, 4); covariance 4.5 over sqrt(4.5 * 5)
    assert rank_correlation([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(4.5 / (4.5 * 5) ** 0.5)
    with pytest.raises(ValueError, match="one length"):
        rank_correlation([1, 2], [1])


def test_a_polynomial_fit_recovers_exact_coefficients_and_measures_its_misfit():
    line = fit_polynomial([2, 4, 8, 16], [7 + 3 * b for b in (2, 4, 8, 16)], 1)
    assert line.coeffs == pytest.approx((7, 3)) and line(10) == pytest.approx(37)
    assert line.max_rel_deviation([2, 4], [13, 19]) == pytest.approx(0)
    quad = fit_polynomial([16, 32, 64, 96], [5 + 2 * t + 0.5 * t * t for t in (16, 32, 64, 96)], 2)
    assert quad.coeffs == pytest.approx((5, 2, 0.5))
    bent = fit_polynomial([1, 2, 3], [1, 4, 9], 1)  # a line through a parabola: y = 4x - 10/3, 2/3 at x = 1
    assert bent.coeffs == pytest.approx((-10 / 3, 4)) and bent.max_rel_deviation([1], [1]) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="at least 3 points"):
        fit_polynomial([1, 2], [1, 2], 2)
