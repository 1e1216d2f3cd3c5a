#!/usr/bin/env python3
"""Tests of hack/shape-check.py (`make lint` runs them before the check itself): each case is
a shape the check once missed or could miss."""

import importlib.util
import os
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("shape_check", os.path.join(HERE, "shape-check.py"))
shape = importlib.util.module_from_spec(spec)
spec.loader.exec_module(shape)


def body(n):
    return ["    let x = 1;"] * n


class Functions(unittest.TestCase):
    def lengths(self, lines):
        return {name: length for name, _, length in shape.functions(lines)}

    def test_a_function_is_measured_from_signature_to_closing_brace(self):
        lines = ["fn f() {"] + body(3) + ["}"]
        self.assertEqual(self.lengths(lines), {"f": 5})

    def test_a_declaration_without_body_is_not_a_function(self):
        lines = ["trait T {", "    fn g(&self) -> u8;", "}"]
        self.assertEqual(self.lengths(lines), {})

    def test_an_array_type_in_the_signature_does_not_hide_the_body(self):
        lines = ["pub fn mac(key: &[u8; 32]) -> [u8; 32] {"] + body(101) + ["}"]
        self.assertEqual(self.lengths(lines), {"mac": 103})

    def test_braces_in_strings_and_comments_do_not_count(self):
        lines = ['fn s() -> &str {', '    // } not the end', '    "}{"', "}"]
        self.assertEqual(self.lengths(lines), {"s": 4})


class ProductionLines(unittest.TestCase):
    def test_counting_stops_at_a_test_module_not_at_any_cfg_test(self):
        lines = ["fn a() {}", "#[cfg(test)]", "fn helper() {}", "fn b() {}",
                 "#[cfg(test)]", "#[allow(dead_code)]", "mod tests {", "}"]
        self.assertEqual(shape.production_lines(lines), lines[:4])


class Circles(unittest.TestCase):
    def test_imports_both_ways_are_a_circle_and_one_way_is_not(self):
        mods = {"a": "use crate::b::X;", "b": "use crate::a::Y;", "c": "use crate::a::Z;"}
        graph = {m: shape.imports(mods, m, code) for m, code in mods.items()}
        self.assertEqual(shape.circles(graph), [["a", "b"]])

    def test_a_grouped_use_names_each_module(self):
        mods = {"a": "use crate::{b::X, c};", "b": "", "c": ""}
        self.assertEqual(shape.imports(mods, "a", mods["a"]), {"b", "c"})

    def test_super_resolves_against_the_parent(self):
        mods = {"p": "", "p::x": "use super::y::T;", "p::y": ""}
        self.assertEqual(shape.imports(mods, "p::x", mods["p::x"]), {"p::y"})


if __name__ == "__main__":
    unittest.main()
