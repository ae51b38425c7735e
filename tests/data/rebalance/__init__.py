"""Tests of the rebalancer (data.rebalance): its plan, its exchange, its cost fit."""
