"""Tests of data.rebalance (the plan, the fit, the exchange) on real length distributions."""
