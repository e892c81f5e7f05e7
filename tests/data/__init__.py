"""Tests of graphtrain.data (a package so test module names cannot clash with other test dirs)."""
