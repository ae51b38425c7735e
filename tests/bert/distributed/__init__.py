"""Tests of bert/distributed/."""
