"""Test and benchmark tools: they measure the package from outside and are no part of it."""
