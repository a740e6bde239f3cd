"""The degenerate-output gate flags compressed rows past its thresholds, with the reasons, never the reference."""

from kvcomp.benchmarks.gate import MAX_KLD_MEAN, flag_degenerate


def test_rows_past_a_threshold_are_flagged_with_every_reason():
    reference = {"codec": "fp16", "reference_key": "r", "kld_mean_chunked": 5.0}  # never flagged, whatever it holds
    fine = {"codec": "kivi", "kld_mean_chunked": 0.08, "kld_mean_chunked_ci95": [2.0, 3.0], "top1_agreement_chunked": 0.9,
            "output_tokens_vs_reference": 1.1, "repetition_rate_vs_reference": 0.05}
    broken = {"codec": "uniform", "kld_mean_chunked": MAX_KLD_MEAN + 0.5, "top1_agreement_chunked": 0.3}
    looping = {"codec": "turboquant", "output_tokens_vs_reference": 2.6, "repetition_rate_vs_reference": 0.4}
    silent = {"codec": "qjl", "output_tokens_vs_reference": 0.2, "acc_avg": 80.0}
    rows = flag_degenerate([reference, fine, broken, looping, silent])
    assert "flag" not in rows[0] and "flag" not in rows[1]  # an interval is not a value; 0.08 nats is fine
    assert rows[2]["flag"] == "kld_mean_chunked 1.5 > 1.0; top1_agreement_chunked 0.3 < 0.5"
    assert rows[3]["flag"] == ("output_tokens_vs_reference 2.6 outside [0.5, 2.0]; "
                               "repetition_rate_vs_reference +0.4 > +0.25")
    assert rows[4]["flag"] == "output_tokens_vs_reference 0.2 outside [0.5, 2.0]"
