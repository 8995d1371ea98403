"""Writes eagle_tap/demo/conversations.jsonl: the conversations `make demo` fires at the tiny target model.

Every line is one conversation, `{"id": "demo-0001", "kind": ..., "messages": [...]}`, in OpenAI messages
form. The text is written here by hand (topics, questions, answers, code, multi-turn exchanges) and
combined into variations; math answers are computed, so they are right.

What must hold for the file written:
- the same bytes on every run and machine: stdlib only, no network, one fixed seed;
- kinds `chat`, `code`, `math` and `multi-turn`; an optional system message, then user and assistant
  messages alternating, ending with an assistant message;
- no answer longer than `MAX_ANSWER_CHARS`, no message with surrounding whitespace, no two equal
  conversations (the client keys a sample by its messages, so a copy would be captured once).

tests/test_demo_conversations.py checks that the committed file is exactly what this script writes.
After editing the content here, regenerate it with

    python scripts/write_demo_conversations.py
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections import Counter
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from textwrap import dedent

REPOSITORY_ROOT = Path(__file__).resolve().parent.parent
OUTPUT_PATH = REPOSITORY_ROOT / "eagle_tap" / "demo" / "conversations.jsonl"
SEED = 20240501
MAX_ANSWER_CHARS = 1200

Message = dict[str, str]
Pairs = list[tuple[str, str]]
"""(user, assistant) exchanges, in order."""


def python_block(code: str) -> str:
    """`code` (indented as written in this file) as a fenced Python block."""
    return "```python\n" + dedent(code).strip("\n") + "\n```"


def messages_of(pairs: Pairs, system: str | None = None) -> list[Message]:
    messages = [{"role": "system", "content": system}] if system else []
    for user, assistant in pairs:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return messages


def money(cents: int) -> str:
    return f"${cents // 100}.{cents % 100:02d}"


def decimal_text(value: Fraction) -> str:
    """`value` written exactly in decimal; only for values with a short terminating expansion."""
    num_digits = 0
    while (value * 10**num_digits).denominator != 1:
        num_digits += 1
        assert num_digits <= 6, f"{value} has no short exact decimal form"
    scaled = int(value * 10**num_digits)
    if num_digits == 0:
        return str(scaled)
    whole, fraction = divmod(abs(scaled), 10**num_digits)
    return f"{'-' if scaled < 0 else ''}{whole}.{fraction:0{num_digits}d}"


# --- chat: definitions, explanations and advice -------------------------------------------------------

CHAT_SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a friendly assistant. Give clear, practical answers.",
    "You are a patient teacher who explains things simply.",
]

CONCEPTS: list[tuple[str, str, str]] = [
    # (term as it reads in a question, one-sentence definition, longer explanation)
    ("recursion",
     "Recursion is when a function solves a problem by calling itself on a smaller version of the same problem.",
     "Recursion solves a problem by reducing it to a smaller instance of the same problem. A recursive function "
     "has a base case, which it answers directly, and a recursive case, which calls the function again on "
     "smaller input. For example, the factorial of n is n times the factorial of n - 1, and the factorial of 0 "
     "is 1. Every call must get closer to the base case, otherwise the recursion never ends. In Python, deep "
     "recursion hits the recursion limit (about 1000 calls by default), so long chains are better written as "
     "loops."),
    ("a hash table",
     "A hash table is a data structure that stores key-value pairs and finds a value from its key in constant "
     "time on average.",
     "A hash table stores key-value pairs in an array of buckets. To store or look up a key, it computes a hash "
     "of the key, a number derived from its contents, and uses it to pick a bucket, so it can go straight to "
     "the right place instead of searching. Two keys can land in the same bucket; the table handles such "
     "collisions and grows when it gets too full. Lookups, inserts and deletes then take constant time on "
     "average. Python's dict and set are hash tables, which is why their keys must be hashable."),
    ("a cache",
     "A cache is a small, fast store that keeps copies of data that is expensive to fetch or compute, so later "
     "requests can be served quickly.",
     "A cache keeps the results of expensive work close at hand so they can be reused. The first request for "
     "an item is a miss: the system does the slow work, such as a database query, and stores the result. Later "
     "requests for the same item are hits and are answered from the cache. Because a cache is smaller than the "
     "data behind it, it needs an eviction policy, such as dropping the least recently used entry. The hard part "
     "is invalidation: knowing when a cached copy is stale because the original has changed."),
    ("latency",
     "Latency is the time between starting a request and getting its response.",
     "Latency is how long one operation takes from start to finish, for example the time from sending a request "
     "to receiving the answer. It is different from throughput, which is how many operations complete per "
     "second: a system can have high throughput and still high latency, like a long pipeline that is always "
     "full. When you measure latency, look at percentiles such as p50 and p99 rather than the average, because "
     "the slowest requests are often the ones users notice."),
    ("an API",
     "An API (application programming interface) is a defined set of operations that one piece of software "
     "offers for other software to use.",
     "An API is the contract between a piece of software and its users: which operations exist, what inputs "
     "they take, what they return and how they fail. A library's API is its public functions and classes; a web "
     "API is a set of URLs that accept requests and return data, often JSON. A good API hides the "
     "implementation, so it can change without breaking callers. That is also why changing an API is costly: "
     "every program that depends on it may need updating."),
    ("version control",
     "Version control is a system that records changes to files over time so you can review history, undo "
     "mistakes and work in parallel.",
     "Version control tracks every change to a set of files as a series of snapshots, with who made each "
     "change, when and why. You can compare versions, go back to an earlier state, and work on separate "
     "branches that are merged later. Git is the most widely used system: every clone holds the full history, "
     "so most operations are local and fast. Even for a solo project, version control makes it safe to "
     "experiment, because nothing you committed is ever really lost."),
    ("a race condition",
     "A race condition is a bug where the result depends on the unpredictable timing of two or more threads or "
     "processes.",
     "A race condition happens when two threads or processes use shared data at the same time and at least one "
     "of them writes to it, so the result depends on which one happens to run first. A classic example is two "
     "threads incrementing the same counter: both read 5, both write 6, and one increment is lost. Race "
     "conditions are hard to debug because they appear only under certain timings and often vanish when you add "
     "logging. The fixes are to protect shared state with a lock, use atomic operations, or avoid sharing by "
     "passing messages."),
    ("a deadlock",
     "A deadlock is a state in which two or more threads wait for each other forever, so none of them can "
     "continue.",
     "A deadlock occurs when each of several threads holds a resource and waits for one held by another, in a "
     "cycle. Thread A holds lock 1 and waits for lock 2, while thread B holds lock 2 and waits for lock 1: "
     "neither can ever proceed. The most reliable prevention is to always acquire locks in the same global "
     "order. Timeouts on acquiring locks, and holding them for as short a time as possible, also help."),
    ("Big-O notation",
     "Big-O notation describes how an algorithm's running time or memory grows as its input gets larger.",
     "Big-O notation gives an upper bound on how the cost of an algorithm grows with the size n of its input, "
     "ignoring constant factors. O(1) means constant time, O(log n) is typical of binary search, O(n) means the "
     "work grows in proportion to the input, and O(n^2) means doubling the input roughly quadruples the work. "
     "It tells you how an algorithm scales, not how fast it is on small inputs: an O(n^2) algorithm with a small "
     "constant can beat an O(n log n) one on ten items."),
    ("a compiler",
     "A compiler is a program that translates source code into another form, usually machine code, before the "
     "program runs.",
     "A compiler reads a whole program in a high-level language and translates it into a lower-level form, such "
     "as machine code for a CPU or bytecode for a virtual machine. Along the way it parses the code, checks it "
     "for errors, and often optimizes it, for example by removing work whose result is never used. The output "
     "runs without the compiler present. C, Rust and Go are typically compiled ahead of time; even CPython "
     "compiles source code to bytecode before running it."),
    ("an interpreter",
     "An interpreter is a program that runs source code directly, statement by statement, instead of producing "
     "a separate executable first.",
     "An interpreter executes a program by reading it and carrying out its instructions as it goes. This makes "
     "the edit-run cycle fast and enables interactive shells like Python's REPL, at the cost of slower "
     "execution than compiled machine code. In practice the line is blurry: CPython first compiles source code "
     "to bytecode and then interprets the bytecode, and many interpreters add a just-in-time compiler that "
     "turns hot code into machine code while the program runs."),
    ("garbage collection",
     "Garbage collection is the automatic freeing of memory that a program can no longer reach.",
     "Garbage collection frees programmers from releasing memory by hand: the runtime finds objects that the "
     "running program can no longer reach and reclaims their memory. CPython mainly uses reference counting, "
     "freeing an object as soon as nothing refers to it, plus a cycle collector that finds groups of objects "
     "that refer only to each other. Other runtimes, like the JVM, use tracing collectors that periodically "
     "mark everything reachable and sweep the rest. Garbage collection prevents most memory-freeing bugs, but "
     "a program can still leak memory by keeping references it no longer needs."),
    ("a mutex",
     "A mutex is a lock that lets only one thread at a time run a section of code or use a shared resource.",
     "A mutex, short for mutual exclusion, protects shared data from being used by several threads at once. A "
     "thread acquires the mutex before touching the data and releases it afterwards; any other thread that "
     "tries to acquire it meanwhile waits. In Python this is `threading.Lock`, best used in a `with` statement "
     "so it is released even when an exception occurs. Keep the locked section short, since waiting threads do "
     "nothing useful."),
    ("a database index",
     "A database index is an extra data structure that lets the database find rows by a column's value without "
     "scanning the whole table.",
     "A database index works like the index at the back of a book: instead of reading every row to find the "
     "ones with a certain value, the database looks the value up in a sorted structure, usually a B-tree, that "
     "points to the matching rows. This turns a full table scan into a fast lookup and also speeds up sorting "
     "and joins on that column. The cost is extra storage and slower writes, since every insert or update must "
     "also update the index. Index the columns you filter and join on, not every column."),
    ("a unit test",
     "A unit test is a small automated test that checks one function or class in isolation.",
     "A unit test checks that a small piece of code, usually one function or class, behaves as expected for "
     "given inputs. Good unit tests are fast, independent of each other, and do not depend on the network or on "
     "a particular machine, so you can run hundreds of them after every change. They catch regressions early "
     "and document how the code is meant to be used. They do not replace integration tests, which check that "
     "the pieces work together."),
    ("a regular expression",
     "A regular expression is a pattern that describes a set of strings, used to search, match or replace "
     "text.",
     "A regular expression is a compact pattern language for text. `\\d+` matches one or more digits, `^` and "
     "`$` anchor a match to the start and end, `[a-z]` matches one lowercase letter, and parentheses capture "
     "parts of a match. Regular expressions are great for validating simple formats and pulling pieces out of "
     "text. They quickly become hard to read, so for nested structures such as HTML or JSON, use a real parser "
     "instead."),
    ("floating-point rounding error",
     "Floating-point rounding error is the small inaccuracy that comes from storing real numbers in a fixed "
     "number of binary digits.",
     "Computers store most real numbers as binary floating-point values with a fixed number of bits, so many "
     "numbers, including simple decimals like 0.1, can only be approximated. Each operation rounds its result "
     "to the nearest representable value, and these tiny errors can add up, which is why `0.1 + 0.2` is "
     "`0.30000000000000004` in Python. Compare floats with a tolerance, using `math.isclose`, instead of `==`, "
     "and use `decimal` or whole cents for money."),
    ("a checksum",
     "A checksum is a small value computed from a block of data, used to detect whether the data was changed "
     "or corrupted.",
     "A checksum is computed from data when it is stored or sent, and computed again when it is read. If the "
     "two values differ, the data was corrupted on the way. Simple checksums such as CRC32 are fast and catch "
     "accidental errors like flipped bits, while cryptographic hashes such as SHA-256 also protect against "
     "deliberate tampering. A matching checksum does not prove the data is correct, only that it has not "
     "changed since the checksum was made."),
    ("data compression",
     "Data compression is encoding data in fewer bits than the original, either exactly (lossless) or "
     "approximately (lossy).",
     "Compression finds redundancy in data and encodes it more compactly. Lossless compression, as in gzip or "
     "zstd, lets you recover the original exactly, which is required for text, code and most data files. Lossy "
     "compression, as in JPEG or MP3, throws away details people are unlikely to notice and gets much smaller "
     "files. There is always a trade-off between ratio and speed: higher levels compress better but take "
     "longer. Data that is already compressed, or random, hardly shrinks at all."),
    ("a cryptographic hash function",
     "A cryptographic hash function maps any input to a fixed-size digest in a way that cannot practically be "
     "reversed or forged.",
     "A cryptographic hash function such as SHA-256 turns any amount of data into a fixed-size digest. The same "
     "input always gives the same digest, a tiny change in the input changes it completely, and it is "
     "practically impossible to find an input for a given digest, or two inputs with the same one. Hashes are "
     "used to verify downloads, identify content and sign data. They are not encryption: there is no key and "
     "no way to get the input back. To store passwords, use a deliberately slow function such as scrypt, "
     "bcrypt or Argon2."),
    ("tokenization in language models",
     "Tokenization is splitting text into the units, called tokens, that a language model reads and writes.",
     "Before a language model can process text, a tokenizer splits it into tokens and maps each one to an "
     "integer id. Modern tokenizers use subword units learned from data, for example with byte-pair encoding: "
     "common words become a single token, while rare words are split into pieces, so any text fits a fixed "
     "vocabulary. The number of tokens, not characters, decides how much context a prompt uses and how long "
     "generation takes. Different models have different tokenizers, so token ids cannot be mixed between "
     "them."),
    ("a language model",
     "A language model is a model that assigns probabilities to sequences of tokens, usually by predicting the "
     "next token from the ones before it.",
     "A language model learns, from large amounts of text, how likely each possible next token is given the "
     "tokens so far. To generate text, it predicts a distribution over the next token, picks one (the most "
     "likely, or a sample), appends it, and repeats. Today's large language models are transformers with "
     "billions of parameters, trained first on general text and then tuned to follow instructions. They "
     "produce fluent text, but they can state false things confidently, so their output needs checking."),
    ("speculative decoding",
     "Speculative decoding speeds up text generation by letting a small draft model propose several tokens "
     "that the large model then verifies in a single pass.",
     "Speculative decoding makes a large language model generate faster without changing its output. A cheap "
     "draft model guesses the next few tokens; the large target model then scores all of them in one forward "
     "pass and accepts the longest prefix that agrees with what it would have generated itself, plus one token "
     "of its own. Because decoding is limited by memory bandwidth, a forward pass over several tokens costs "
     "about as much as one, so every accepted token saves time. The speed-up depends on how often the target "
     "accepts the draft's guesses."),
    ("a KV cache",
     "A KV cache stores the attention keys and values of tokens a transformer has already processed, so they "
     "are not recomputed for every new token.",
     "In a transformer, each new token attends to the keys and values of all earlier tokens. Without a cache, "
     "generating each token would recompute them for the whole sequence. The KV cache keeps them in memory, so "
     "every step only computes the new token's keys and values. This makes generation much faster, but the "
     "cache grows with sequence length and batch size and can use more GPU memory than the model weights. "
     "Serving systems such as vLLM and SGLang work hard to manage it, for example by sharing cached prefixes "
     "between requests."),
    ("overfitting",
     "Overfitting is when a model learns its training data too closely, including its noise, and does worse on "
     "new data as a result.",
     "A model overfits when it fits the training examples so closely that it memorizes their quirks instead of "
     "learning the general pattern. The sign is a training loss that keeps falling while the loss on held-out "
     "validation data stops improving or gets worse. Common remedies are more or more varied training data, a "
     "smaller model, regularization such as weight decay or dropout, and stopping training where the "
     "validation loss is lowest."),
    ("gradient descent",
     "Gradient descent is an optimization method that repeatedly moves the parameters a small step in the "
     "direction that reduces the loss fastest.",
     "Gradient descent trains a model by minimizing a loss function. At each step it computes the gradient, the "
     "direction in which the loss increases fastest, and moves the parameters a small step the opposite way; "
     "the size of that step is the learning rate. In practice the gradient is estimated on a small random batch "
     "of data (stochastic gradient descent), and optimizers such as Adam adapt the step for each parameter. It "
     "finds a good solution, not necessarily the best possible one, which is usually enough for neural "
     "networks."),
    ("the learning rate",
     "The learning rate is the size of the steps an optimizer takes when it updates a model's parameters.",
     "The learning rate scales how far the parameters move at each training step. Too high, and training is "
     "unstable: the loss jumps around or diverges. Too low, and training is slow and can stall. It is usually "
     "the most important hyperparameter to tune. Most training runs also change it over time with a schedule, "
     "for example a short warmup from zero followed by a gradual decay."),
    ("the batch size in training",
     "The batch size is the number of training examples used to compute one parameter update.",
     "During training, the gradient is averaged over a batch of examples before the parameters are updated. "
     "Larger batches give a less noisy gradient and use the hardware more efficiently, but each update costs "
     "more, and beyond a point they stop helping. Smaller batches are noisier, which can even help "
     "generalization, and need less memory. When you change the batch size a lot, the learning rate usually "
     "needs to change with it."),
    ("an embedding",
     "An embedding is a vector of numbers that represents an item, such as a word or token, so that similar "
     "items get similar vectors.",
     "An embedding maps a discrete item, such as a token, a word or a product, to a dense vector of a few "
     "hundred or thousand numbers. The vectors are learned so that items used in similar ways end up close "
     "together, which lets a model generalize between them. In a language model, the embedding table is the "
     "first layer: it turns each token id into a vector. Embeddings of whole sentences are used for semantic "
     "search, by comparing vectors with cosine similarity."),
    ("attention in transformers",
     "Attention is the mechanism that lets each token in a transformer gather information from other tokens, "
     "weighted by how relevant they are.",
     "In attention, each token produces a query, and every token produces a key and a value. The query is "
     "compared with all keys to get weights that say how relevant each token is, and the output is the "
     "weighted sum of the values. This lets the model connect words that are far apart. Transformers run "
     "several attention heads in parallel, and in a language model each token may only attend to earlier "
     "tokens. The cost grows with the square of the sequence length, which is why long contexts are "
     "expensive."),
    ("a virtual environment",
     "A virtual environment is an isolated Python installation for one project, with its own set of installed "
     "packages.",
     "A virtual environment is a directory with its own Python interpreter and package folder. Packages you "
     "install while it is active go there instead of into the system Python, so each project can have the "
     "versions it needs without conflicts. You create one with `python -m venv .venv` and activate it before "
     "working on the project. Do not commit the environment itself; commit a requirements file or "
     "`pyproject.toml` from which it can be rebuilt."),
    ("a container",
     "A container is a lightweight, isolated environment that packages an application with everything it "
     "needs to run.",
     "A container bundles an application with its libraries, tools and settings into an image that runs the "
     "same way on any machine with a container runtime such as Docker. Unlike a virtual machine, a container "
     "shares the host's operating-system kernel, so it starts in seconds and adds little overhead. Containers "
     "make deployments reproducible: you build the image once and run that exact image in testing and "
     "production. They isolate processes, but they are a weaker security boundary than a virtual machine."),
    ("DNS",
     "DNS, the Domain Name System, translates human-readable domain names like example.com into IP addresses.",
     "DNS is the internet's phone book. When you visit a website, your computer asks a DNS resolver for the IP "
     "address behind the name. The resolver finds it by asking the root servers, then the servers for the "
     "top-level domain such as .com, then the domain's own name servers, and it caches the answer for as long "
     "as the record's time to live allows. That caching is why DNS changes can take a while to reach everyone. "
     "Besides addresses, DNS holds other records, such as the mail servers of a domain."),
    ("an HTTP status code",
     "An HTTP status code is the three-digit number in a response that tells the client whether its request "
     "succeeded and, if not, why.",
     "Every HTTP response starts with a three-digit status code, grouped by its first digit. 2xx means success "
     "(200 OK, 201 Created), 3xx means redirection (301 Moved Permanently, 304 Not Modified), 4xx means the "
     "client made a mistake (400 Bad Request, 401 Unauthorized, 404 Not Found), and 5xx means the server failed "
     "(500 Internal Server Error, 503 Service Unavailable). Clients should check the code before trusting the "
     "body, and APIs should use the code that matches what really happened."),
    ("idempotence",
     "An operation is idempotent if performing it several times has the same effect as performing it once.",
     "An idempotent operation can be repeated safely: doing it twice leaves the system in the same state as "
     "doing it once. Setting a value is idempotent, while incrementing a counter is not. This matters whenever "
     "a request may be retried after a timeout, because the client cannot tell whether the first attempt "
     "succeeded. In HTTP, GET, PUT and DELETE are meant to be idempotent and POST is not; many APIs accept an "
     "idempotency key so that a retried POST is applied only once."),
    ("a memory leak",
     "A memory leak is when a program keeps holding memory it no longer needs, so its memory use grows over "
     "time.",
     "A memory leak happens when a program allocates memory and never releases it, even though it no longer "
     "needs it. With manual memory management it usually means a missing free. In garbage-collected languages "
     "like Python it means something still holds a reference: a cache that grows without limit, a global list "
     "that is only ever appended to, or event handlers that are never removed. The symptom is memory use that "
     "keeps rising the longer the program runs; `tracemalloc` shows which lines allocated the memory that "
     "stays."),
]

SHORT_QUESTIONS = ["Define {term} in one sentence.", "What is {term}? Answer in one sentence.",
                   "Give me a one-line definition of {term}."]
LONG_QUESTIONS = ["What is {term}?", "Can you explain {term}?", "Explain {term} to a beginner.",
                  "What is {term}, and why does it matter?"]

ADVICE: Pairs = [
    ("How do I write a good commit message?",
     "Start with a short summary line, about 50 characters, in the imperative mood: \"Fix crash when the config "
     "file is empty\", not \"Fixed stuff\". Leave a blank line, then explain why the change was needed and "
     "anything surprising about how it works; the diff already shows what changed. Keep each commit focused on "
     "one logical change, so that its message can describe it fully."),
    ("How should I name variables?",
     "Name a variable after what it holds, in words a newcomer would understand: `retry_count` rather than "
     "`rc`, `user_by_id` rather than `d`. Put units in the name when there are any, like `timeout_s` or "
     "`size_bytes`. Short names are fine for tiny scopes, such as `i` in a three-line loop. If you cannot find "
     "a good name, the variable may be doing more than one job."),
    ("Any tips for reading someone else's code?",
     "Start from the outside: read the README, then find the entry point and follow one real request or "
     "command through the code. Run it and use a debugger or print statements to see actual values, which is "
     "faster than reasoning about every branch. Read the tests, since they show how the code is meant to be "
     "used. Sketch the main components as you go, and do not try to understand everything at once."),
    ("How do I prepare for a technical interview?",
     "Practise solving problems out loud, since interviews test how you think as much as the answer. Review "
     "the basics: common data structures, their costs, and a few standard algorithms such as sorting, binary "
     "search and graph traversal. Do a couple of mock interviews with a friend under time pressure. Prepare "
     "short stories about past work: a hard bug, a disagreement, something you are proud of. And ask the "
     "interviewer questions at the end; it shows genuine interest."),
    ("How do I ask a good question on a programming forum?",
     "Say what you are trying to do, what you tried, and what happened instead, with the exact error message. "
     "Include a minimal example that others can run and that still shows the problem; building it often "
     "reveals the answer. Mention your language version and platform when they might matter. A title that "
     "sums up the problem gets far more helpful replies than \"Help, code not working\"."),
    ("How can I make my Python script faster?",
     "Measure first: run it under `cProfile` to find where the time actually goes, because it is rarely where "
     "you expect. Then improve the algorithm or data structure at that hot spot, for example a set instead of a "
     "list for membership tests. Push loops into built-ins and libraries written in C, such as `sum`, `sorted` "
     "or NumPy. Only after that consider caching, multiprocessing, or rewriting a small core in a faster "
     "language."),
    ("How should I structure a small Python project?",
     "Put your code in a package folder, tests in a `tests` folder, and metadata in a `pyproject.toml` at the "
     "root, next to a README. Keep modules small and focused on one job, and keep the command-line entry point "
     "thin, calling functions that do the real work. Declare your dependencies in one place, and set up a test "
     "runner such as pytest from the first day."),
    ("What is the best way to learn a new programming language?",
     "Build something small but real with it as soon as possible, like a command-line tool you would actually "
     "use. Read the official tutorial first for the language's main ideas, then read idiomatic code in "
     "well-regarded projects. Pay attention to what differs from languages you know, such as error handling or "
     "memory management, rather than what is the same. Writing tests for your own code is also a good way to "
     "learn the standard library."),
    ("How do I give useful code review feedback?",
     "Focus on what matters most, correctness, clarity and whether the design fits, before style nits. Be "
     "specific and explain why: \"this loop reads the file twice; could we keep the lines from the first "
     "pass?\" helps more than \"inefficient\". Ask questions when you are unsure rather than making demands. "
     "Mark small suggestions as optional, and say what you liked too."),
    ("How do I stop procrastinating on a big task?",
     "Make the first step tiny and concrete, like \"open the document and write the headings\", so that "
     "starting feels easy. Work in short timed blocks, say 25 minutes, with your phone out of reach. Decide the "
     "evening before what you will work on first the next day. Once you have started, momentum usually carries "
     "you further than you planned."),
    ("How do I write good documentation for my code?",
     "Write for a reader who is new to the project. Start with what the code is for and a short example of "
     "using it; that answers most questions. Document the why and the guarantees, what must hold and what can "
     "fail, rather than restating what each line does. Keep docs next to the code, in docstrings and the "
     "README, so they get updated together, and delete documentation that has gone stale."),
    ("How do I debug a program that only crashes sometimes?",
     "First make it crash more often: run it in a loop, under more load, or with different timings, and record "
     "the inputs of each run. Log enough context, such as thread names, timestamps and inputs, to reconstruct "
     "what happened before a crash. Intermittent failures usually come from shared state, timing, "
     "uninitialized data or external services, so look there first. Once you can reproduce it reliably, the "
     "fix is usually the easy part."),
    ("How much should I comment my code?",
     "Comment the why, not the what. Clear names and small functions should already say what the code does; a "
     "comment is for what the code cannot say, such as why a strange-looking workaround is needed or which "
     "constraint a choice satisfies. Outdated comments are worse than none, so keep them few and update them "
     "with the code."),
    ("How can I sleep better?",
     "Keep a regular schedule, going to bed and getting up at the same time even at weekends. Get daylight in "
     "the morning, and keep the bedroom dark, cool and quiet. Avoid caffeine in the afternoon and heavy meals "
     "or alcohol late in the evening. If you cannot sleep after about 20 minutes, get up and do something calm "
     "in dim light until you feel sleepy again."),
    ("How do I keep a houseplant alive?",
     "Most houseplants die from too much water, not too little. Water only when the top few centimetres of "
     "soil are dry, and use a pot with a drainage hole so the roots never sit in water. Put the plant where it "
     "gets the light its label asks for; most common houseplants like bright, indirect light. Feed it lightly "
     "in spring and summer, and not at all in winter."),
    ("How do I make good coffee with a French press?",
     "Use coarsely ground coffee, about 60 grams per litre of water, or 15 grams for a 250 ml cup. Pour water "
     "just off the boil, around 93 to 96 degrees Celsius, stir, and put the lid on. Wait four minutes, then "
     "press the plunger down slowly and pour right away, since coffee left on the grounds turns bitter. Adjust "
     "the amount of coffee or the steeping time to taste."),
    ("How can I remember more of what I read?",
     "Read actively: before you start, ask what you want to learn, and after each chapter close the book and "
     "write down the main points in your own words. Explaining an idea to someone else is one of the best "
     "memory aids. Review your notes after a day and again after a week, since spaced review beats rereading. "
     "And read fewer things more carefully rather than skimming many."),
    ("How do I start running as a complete beginner?",
     "Start with intervals: alternate one minute of easy running with two minutes of walking for about 20 "
     "minutes, three times a week. Run slowly enough that you could hold a conversation. Each week, run a "
     "little more and walk a little less, raising your total time by no more than about 10 percent. Good shoes "
     "and rest days matter more than any gadget; mild soreness is normal, sharp pain is a sign to stop."),
    ("How do I politely decline a meeting invitation?",
     "Reply promptly, thank the organizer, and say clearly that you cannot attend, without a long excuse. "
     "Offer an alternative when you can: a colleague who could go instead, written input before the meeting, "
     "or a quick chat afterwards. For example: \"Thanks for the invite. I can't make it on Thursday, but I've "
     "added my comments to the doc and I'm happy to catch up afterwards.\""),
    ("What is a good way to back up my files?",
     "Follow the 3-2-1 rule: keep three copies of your data, on two different kinds of storage, with one copy "
     "off-site, such as in the cloud or at a friend's house. Automate the backups so they happen without you "
     "having to remember. Most importantly, try a restore now and then: a backup you have never restored from "
     "is only a hope."),
    ("How do I choose a strong password?",
     "Length matters more than complexity: a passphrase of four or five random, unrelated words is both strong "
     "and easy to remember. Never reuse a password across sites, because one leak then opens all your "
     "accounts. The practical way to manage that is a password manager, which generates and remembers a unique "
     "random password for every site. Turn on two-factor authentication wherever it is offered."),
    ("How do I break a large task into smaller ones?",
     "Start from the end result and ask what must be true for it to be done, then work backwards. Split until "
     "each piece can be finished in a day or less and has a clear \"done\" condition. Put the riskiest or least "
     "understood pieces first; they are the ones most likely to change the plan. Keep the list visible and "
     "tick pieces off as you go."),
    ("How do I focus better when working from home?",
     "Keep a dedicated workspace, even a small corner, that you use only for work, and start and stop at set "
     "times. Pick the day's two or three most important tasks in the morning and do them before checking "
     "messages. Turn off notifications and put your phone in another room during focus blocks. Short breaks "
     "with a bit of movement help more than pushing through."),
    ("How do I get better at estimating how long tasks will take?",
     "Write down your estimate before you start and compare it with the actual time afterwards; most people "
     "find they underestimate by a fairly consistent factor. Break the task into pieces and estimate those, "
     "since small pieces are easier to judge. Add time for what is always forgotten: testing, review and "
     "interruptions. And give ranges, such as \"two to four days\", instead of a single number."),
]


def chat_conversations() -> list[list[Message]]:
    conversations = []
    for index, (term, definition, explanation) in enumerate(CONCEPTS):
        short_question = SHORT_QUESTIONS[index % len(SHORT_QUESTIONS)].format(term=term)
        long_question = LONG_QUESTIONS[index % len(LONG_QUESTIONS)].format(term=term)
        system = CHAT_SYSTEM_PROMPTS[index % len(CHAT_SYSTEM_PROMPTS)] if index % 3 == 0 else None
        conversations.append(messages_of([(short_question, definition)]))
        conversations.append(messages_of([(long_question, explanation)], system))
    for index, pair in enumerate(ADVICE):
        system = CHAT_SYSTEM_PROMPTS[index % len(CHAT_SYSTEM_PROMPTS)] if index % 4 == 1 else None
        conversations.append(messages_of([pair], system))
    return conversations


# --- code: the standard library, functions to write, bugs to fix --------------------------------------

CODE_SYSTEM_PROMPTS = [
    "You are an expert Python developer. Answer briefly and show working code.",
    "You are a Python tutor. Give clear, accurate answers about the language and its library.",
]

STDLIB_QUESTIONS = ["What does `{name}` do?", "Explain `{name}` briefly.", "How do I use `{name}`?",
                    "What is `{name}` for?"]

STDLIB: Pairs = [
    # (name, answer)
    ("shutil.copyfile",
     "`shutil.copyfile(src, dst)` copies the contents of the file `src` to the file `dst` and returns `dst`. It "
     "copies only the data: permissions and timestamps are not copied (use `shutil.copy2` for that). `dst` "
     "must be a file name, not a directory, and an existing `dst` is overwritten. If both name the same file, "
     "it raises `shutil.SameFileError`.\n\n"
     + python_block("""
        import shutil

        shutil.copyfile("config.ini", "config.ini.bak")
        """)),
    ("shutil.rmtree",
     "`shutil.rmtree(path)` deletes a directory and everything inside it, recursively. It is the tool for "
     "removing a non-empty directory, which `os.rmdir` refuses to do. Be careful: nothing goes to a trash "
     "folder, the files are simply gone. Pass `ignore_errors=True` to skip what cannot be removed instead of "
     "raising."),
    ("shutil.which",
     "`shutil.which(cmd)` returns the full path of the program that would run if you typed `cmd` in a shell, "
     "searching the directories listed in `PATH`. It returns `None` when there is no such program, which makes "
     "it a simple way to check that a tool is installed before calling it.\n\n"
     + python_block("""
        import shutil

        if shutil.which("git") is None:
            raise SystemExit("git is not installed; install it and try again")
        """)),
    ("os.path.join",
     "`os.path.join(first, *parts)` joins path components with the separator of the current platform, `/` on "
     "Linux and macOS and `\\` on Windows. If a later part is an absolute path, everything before it is "
     "dropped, so `os.path.join(\"/data\", \"/tmp\")` returns `\"/tmp\"`. In new code, `pathlib.Path(\"data\") "
     "/ \"file.txt\"` does the same job."),
    ("os.path.splitext",
     "`os.path.splitext(path)` splits a path into a pair `(root, ext)`, where `ext` is the last extension "
     "including its dot. `os.path.splitext(\"report.tar.gz\")` returns `(\"report.tar\", \".gz\")`, and a "
     "name without an extension gives an empty `ext`. Leading dots do not count, so `\".bashrc\"` has no "
     "extension."),
    ("os.makedirs",
     "`os.makedirs(path)` creates a directory together with any missing parent directories, like `mkdir -p`. "
     "By default it raises `FileExistsError` if the directory already exists; pass `exist_ok=True` to make "
     "that case a no-op.\n\n"
     + python_block("""
        import os

        os.makedirs("out/logs/2024", exist_ok=True)
        """)),
    ("os.environ.get",
     "`os.environ` is a mapping of the process's environment variables, and `os.environ.get(name, default)` "
     "reads one without raising when it is missing. The values are always strings, so convert them "
     "yourself.\n\n"
     + python_block("""
        import os

        debug = os.environ.get("DEBUG", "0") == "1"
        num_workers = int(os.environ.get("NUM_WORKERS", "4"))
        """)),
    ("pathlib.Path.rglob",
     "`Path.rglob(pattern)` yields every path below a directory, at any depth, whose name matches the glob "
     "`pattern`. It behaves like `Path.glob` with `**/` in front of the pattern.\n\n"
     + python_block("""
        from pathlib import Path

        for path in Path("src").rglob("*.py"):
            print(path)
        """)),
    ("pathlib.Path.read_text",
     "`Path.read_text()` opens the file, reads it whole as a string and closes it again, all in one call. Pass "
     "`encoding=\"utf-8\"` explicitly, since the default depends on the platform. Its partners are "
     "`write_text`, `read_bytes` and `write_bytes`.\n\n"
     + python_block("""
        from pathlib import Path

        text = Path("notes.txt").read_text(encoding="utf-8")
        """)),
    ("json.dumps",
     "`json.dumps(obj)` turns a Python object made of dicts, lists, strings, numbers, booleans and `None` into "
     "a JSON string. Useful options are `indent=2` for readable output, `sort_keys=True` for a stable key "
     "order, and `ensure_ascii=False` to keep non-ASCII characters as they are. Objects it does not know, such "
     "as a `datetime`, raise `TypeError` unless you pass a `default=` function that converts them."),
    ("json.loads",
     "`json.loads(text)` parses a JSON string and returns the matching Python objects: objects become dicts, "
     "arrays become lists, and `true`, `false` and `null` become `True`, `False` and `None`. Invalid input "
     "raises `json.JSONDecodeError`, a subclass of `ValueError`. To read straight from an open file, use "
     "`json.load(file)`."),
    ("collections.Counter",
     "`Counter` is a dict subclass that counts hashable items. Give it any iterable and it maps each item to "
     "how often it appears; a missing item counts as 0 instead of raising `KeyError`. `most_common(n)` returns "
     "the n most frequent items with their counts.\n\n"
     + python_block("""
        from collections import Counter

        counts = Counter("mississippi")
        print(counts.most_common(2))  # [('i', 4), ('s', 4)]
        """)),
    ("collections.defaultdict",
     "`defaultdict(factory)` is a dict that calls `factory()` to create a value the first time a missing key "
     "is read. `defaultdict(list)` is the usual way to group items, since you can append without checking "
     "whether the key exists yet.\n\n"
     + python_block("""
        from collections import defaultdict

        words_by_length = defaultdict(list)
        for word in ["tea", "milk", "cup", "bread"]:
            words_by_length[len(word)].append(word)
        # {3: ['tea', 'cup'], 4: ['milk'], 5: ['bread']}
        """)),
    ("collections.deque",
     "`deque` is a double-ended queue: appending and popping at either end (`append`, `appendleft`, `pop`, "
     "`popleft`) take constant time, unlike `list.pop(0)`, which shifts every other element. With "
     "`maxlen=n` it keeps only the last n items, which is handy for a sliding window or a short history."),
    ("collections.namedtuple",
     "`namedtuple(\"Point\", [\"x\", \"y\"])` creates a tuple subclass whose fields can be read by name as "
     "well as by index. Instances are immutable, lightweight and print nicely, as `Point(x=1, y=2)`. For "
     "classes with defaults, type hints or methods, `dataclasses.dataclass` or `typing.NamedTuple` usually "
     "read better."),
    ("itertools.chain",
     "`itertools.chain(*iterables)` yields the items of the first iterable, then of the second, and so on, "
     "without building a new list. `chain.from_iterable(lists)` does the same for an iterable of iterables, "
     "which makes it a cheap way to flatten one level.\n\n"
     + python_block("""
        from itertools import chain

        print(list(chain([1, 2], (3,), "ab")))  # [1, 2, 3, 'a', 'b']
        """)),
    ("itertools.groupby",
     "`itertools.groupby(iterable, key)` groups consecutive items that have the same key and yields "
     "`(key, group)` pairs. It only groups neighbours, so sort by the same key first if equal items can be "
     "spread out. Each group is an iterator that is used up when you move on to the next one, so turn it into "
     "a list if you need to keep it.\n\n"
     + python_block("""
        from itertools import groupby

        words = sorted(["banana", "apple", "cherry", "avocado", "blueberry"])
        for letter, group in groupby(words, key=lambda word: word[0]):
            print(letter, list(group))
        """)),
    ("itertools.product",
     "`itertools.product(*iterables)` yields the Cartesian product: every tuple that takes one item from each "
     "input, just like nested for loops. `product(\"ab\", [1, 2])` yields `('a', 1)`, `('a', 2)`, `('b', 1)` "
     "and `('b', 2)`, and `product(range(2), repeat=3)` yields all eight tuples of three bits."),
    ("functools.lru_cache",
     "`@functools.lru_cache(maxsize=128)` memoizes a function: it keeps the results for the most recent "
     "argument combinations and returns a stored result when the function is called again with the same "
     "arguments, which must be hashable. `maxsize=None`, or `@functools.cache`, keeps every result, and "
     "`cache_info()` reports hits and misses.\n\n"
     + python_block("""
        from functools import lru_cache

        @lru_cache(maxsize=None)
        def fibonacci(n: int) -> int:
            return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)
        """)),
    ("functools.partial",
     "`functools.partial(func, *args, **kwargs)` returns a new callable with some of `func`'s arguments "
     "already filled in. For example, `parse_hex = partial(int, base=16)` makes `parse_hex(\"ff\")` return "
     "255. It is often used to pass a configured function as a callback."),
    ("functools.reduce",
     "`functools.reduce(function, iterable, initial)` folds the items of an iterable into one value by "
     "applying a two-argument function from left to right: `reduce(f, [a, b, c])` computes `f(f(a, b), c)`. "
     "Pass an initial value so that an empty iterable does not raise `TypeError`. For sums, products and "
     "maxima, `sum`, `math.prod` and `max` say the same thing more clearly."),
    ("enumerate",
     "`enumerate(iterable, start=0)` yields pairs `(index, item)`, so you get each item's position without "
     "keeping a counter yourself. Use `start=1` for numbering meant for people.\n\n"
     + python_block("""
        for number, line in enumerate(["first", "second"], start=1):
            print(f"{number}: {line}")
        """)),
    ("zip",
     "`zip(*iterables)` yields tuples that take one item from each iterable in turn, stopping at the shortest "
     "one. Since Python 3.10, `zip(a, b, strict=True)` raises `ValueError` when the lengths differ instead of "
     "silently dropping the extra items. `itertools.zip_longest` pads the shorter inputs instead."),
    ("sorted",
     "`sorted(iterable, key=None, reverse=False)` returns a new sorted list and leaves the input unchanged, "
     "unlike `list.sort()`, which sorts in place and returns `None`. The `key` function maps each item to the "
     "value to compare, as in `sorted(words, key=len)`. The sort is stable: items with equal keys keep their "
     "original order."),
    ("dataclasses.dataclass",
     "The `@dataclass` decorator writes `__init__`, `__repr__` and `__eq__` for a class from its annotated "
     "fields. `frozen=True` makes instances immutable, `order=True` adds comparison methods, and a mutable "
     "default needs `field(default_factory=list)`.\n\n"
     + python_block("""
        from dataclasses import dataclass, field

        @dataclass
        class Order:
            customer: str
            items: list[str] = field(default_factory=list)
        """)),
    ("contextlib.contextmanager",
     "`@contextlib.contextmanager` turns a generator function into a context manager for `with` statements. "
     "The code before `yield` runs on entry, the yielded value is what `as` binds, and the code after it runs "
     "on exit; put that part in `finally` so it also runs when the body raises.\n\n"
     + python_block("""
        import contextlib
        import time

        @contextlib.contextmanager
        def timer(label):
            start = time.perf_counter()
            try:
                yield
            finally:
                print(f"{label}: {time.perf_counter() - start:.3f} s")
        """)),
    ("subprocess.run",
     "`subprocess.run(args)` starts a program, waits for it to finish and returns a `CompletedProcess` with "
     "its `returncode`. Pass the command as a list to avoid shell quoting problems, `capture_output=True, "
     "text=True` to get `stdout` and `stderr` as strings, and `check=True` to raise `CalledProcessError` when "
     "the exit code is not zero.\n\n"
     + python_block("""
        import subprocess

        result = subprocess.run(["git", "status", "--short"], capture_output=True, text=True, check=True)
        print(result.stdout)
        """)),
    ("re.sub",
     "`re.sub(pattern, repl, string)` returns a copy of `string` with every match of the regular expression "
     "replaced by `repl`. `repl` can refer to groups as `\\1` or `\\g<name>`, or be a function that receives "
     "each match object; `count=` limits the number of replacements.\n\n"
     + python_block(r"""
        import re

        print(re.sub(r"\s+", " ", "too   many    spaces"))  # too many spaces
        """)),
    ("re.findall",
     "`re.findall(pattern, string)` returns all non-overlapping matches as a list of strings. If the pattern "
     "has one group, the list holds that group's text; with several groups, it holds tuples. Use "
     "`re.finditer` when you need match objects, for example for positions.\n\n"
     + python_block(r"""
        import re

        print(re.findall(r"\d+", "3 apples and 12 pears"))  # ['3', '12']
        """)),
    ("datetime.timedelta",
     "`timedelta` represents a duration, such as `timedelta(days=2, hours=3)`. Adding it to a `datetime` or "
     "`date` shifts that moment, and subtracting two datetimes gives a `timedelta`. `total_seconds()` converts "
     "a duration to seconds as a float."),
    ("time.perf_counter",
     "`time.perf_counter()` returns the value of a high-resolution clock, in seconds, as a float. Only the "
     "difference between two calls means anything, which makes it the right clock for timing code; "
     "`time.time()` can jump when the system clock is adjusted.\n\n"
     + python_block("""
        import time

        start = time.perf_counter()
        total = sum(range(1_000_000))
        elapsed_s = time.perf_counter() - start
        """)),
    ("heapq.heappush",
     "`heapq.heappush(heap, item)` adds an item to a list kept in heap order, and `heapq.heappop(heap)` "
     "removes and returns the smallest item, both in O(log n) time; the smallest item is always `heap[0]`. "
     "For a max-heap, push negated priorities. To get the n smallest items of a collection once, "
     "`heapq.nsmallest(n, items)` is simpler."),
    ("bisect.bisect_left",
     "`bisect.bisect_left(a, x)` does a binary search on the sorted list `a` and returns the index where `x` "
     "would be inserted to keep it sorted, before any equal items. `bisect_right` returns the position after "
     "equal items, and `insort` inserts directly. Each search takes O(log n) time, though `insort` still "
     "costs O(n) to shift the list."),
    ("tempfile.TemporaryDirectory",
     "`tempfile.TemporaryDirectory()` creates a fresh directory with a unique name and deletes it, with "
     "everything inside, when the `with` block ends. The `as` target is the directory's path as a string.\n\n"
     + python_block("""
        import tempfile
        from pathlib import Path

        with tempfile.TemporaryDirectory() as directory:
            scratch = Path(directory) / "scratch.txt"
            scratch.write_text("temporary", encoding="utf-8")
        # the directory and scratch.txt are gone here
        """)),
    ("argparse.ArgumentParser.add_argument",
     "`parser.add_argument(...)` declares one command-line argument of an `argparse.ArgumentParser`. Names "
     "without dashes are positional and names starting with `--` are options; `type=int` converts the value, "
     "`default=` is used when it is missing, and `action=\"store_true\"` makes a flag. `parser.parse_args()` "
     "then returns a namespace with one attribute per argument.\n\n"
     + python_block("""
        import argparse

        parser = argparse.ArgumentParser(description="Resize images.")
        parser.add_argument("folder")
        parser.add_argument("--width", type=int, default=800)
        parser.add_argument("--dry-run", action="store_true")
        args = parser.parse_args()
        """)),
    ("logging.getLogger",
     "`logging.getLogger(name)` returns the logger with that name, creating it the first time; the same name "
     "always gives the same logger object. The usual pattern is `logger = logging.getLogger(__name__)` at the "
     "top of each module, so records carry the module's name and logging can be configured per package."),
    ("textwrap.dedent",
     "`textwrap.dedent(text)` removes the leading whitespace that every non-blank line of `text` has in "
     "common. It lets you indent a multi-line string along with the surrounding code and still get its "
     "content flush left."),
    ("hashlib.sha256",
     "`hashlib.sha256(data)` creates a SHA-256 hash object from bytes; `.hexdigest()` gives the 64-character "
     "hex string and `.digest()` the 32 raw bytes. For large files, call `.update(chunk)` repeatedly instead "
     "of reading everything into memory. It is not a way to store passwords; use a slow function such as "
     "`hashlib.scrypt` for that.\n\n"
     + python_block("""
        import hashlib

        def file_sha256(path) -> str:
            digest = hashlib.sha256()
            with open(path, "rb") as file:
                for chunk in iter(lambda: file.read(1 << 20), b""):
                    digest.update(chunk)
            return digest.hexdigest()
        """)),
    ("statistics.median",
     "`statistics.median(data)` returns the middle value of numeric data. With an even number of values it "
     "returns the mean of the two middle ones, so `median([1, 3, 5, 7])` is `4.0`. Unlike the mean, the "
     "median hardly moves when a few values are extreme. An empty input raises `statistics.StatisticsError`."),
    ("csv.DictReader",
     "`csv.DictReader(file)` reads a CSV file row by row and yields each row as a dict keyed by the column "
     "names in the header line. Open the file with `newline=\"\"`, as the csv module asks, and remember that "
     "every value comes back as a string.\n\n"
     + python_block("""
        import csv

        with open("people.csv", newline="", encoding="utf-8") as file:
            for row in csv.DictReader(file):
                print(row["name"], int(row["age"]))
        """)),
]

FUNCTIONS: list[tuple[str, str, str]] = [
    # (request, code, a sentence about the code)
    ("Write a function that reverses the order of the words in a sentence.",
     """
     def reverse_words(sentence: str) -> str:
         return " ".join(reversed(sentence.split()))
     """,
     "`split()` without an argument also collapses runs of spaces, so `reverse_words(\"hello   big world\")` "
     "returns `\"world big hello\"`."),
    ("Write a Python function that checks whether a string is a palindrome, ignoring case, spaces and "
     "punctuation.",
     """
     def is_palindrome(text: str) -> bool:
         letters = [char.lower() for char in text if char.isalnum()]
         return letters == letters[::-1]
     """,
     "It keeps only letters and digits, so `is_palindrome(\"A man, a plan, a canal: Panama\")` returns "
     "`True`."),
    ("How do I count the vowels in a string?",
     """
     def count_vowels(text: str) -> int:
         return sum(1 for char in text.lower() if char in "aeiou")
     """,
     "For example, `count_vowels(\"Programming\")` returns 3."),
    ("Write a function that returns the n-th Fibonacci number without recursion.",
     """
     def fibonacci(n: int) -> int:
         a, b = 0, 1
         for _ in range(n):
             a, b = b, a + b
         return a
     """,
     "It runs in O(n) time and constant memory: `fibonacci(0)` is 0 and `fibonacci(10)` is 55."),
    ("Write a function that flattens a list of lists by one level.",
     """
     from itertools import chain

     def flatten(lists):
         return list(chain.from_iterable(lists))
     """,
     "`flatten([[1, 2], [3], []])` returns `[1, 2, 3]`."),
    ("Write a function that splits a list into chunks of size n.",
     """
     def chunks(items: list, size: int) -> list[list]:
         if size < 1:
             raise ValueError(f"size must be at least 1, got {size}")
         return [items[start:start + size] for start in range(0, len(items), size)]
     """,
     "The last chunk may be shorter: `chunks([1, 2, 3, 4, 5], 2)` returns `[[1, 2], [3, 4], [5]]`."),
    ("How can I remove duplicates from a list but keep the original order?",
     """
     def unique(items: list) -> list:
         return list(dict.fromkeys(items))
     """,
     "Dicts keep insertion order, so `unique([3, 1, 3, 2, 1])` returns `[3, 1, 2]`. The items must be "
     "hashable."),
    ("Write an is_prime function in Python.",
     """
     def is_prime(n: int) -> bool:
         if n < 2:
             return False
         divisor = 2
         while divisor * divisor <= n:
             if n % divisor == 0:
                 return False
             divisor += 1
         return True
     """,
     "It only tries divisors up to the square root of n: a larger factor would pair with a smaller one "
     "already tried."),
    ("Write a function that computes n! iteratively.",
     """
     def factorial(n: int) -> int:
         if n < 0:
             raise ValueError(f"factorial is not defined for negative numbers, got {n}")
         result = 1
         for factor in range(2, n + 1):
             result *= factor
         return result
     """,
     "`math.factorial` does the same in the standard library."),
    ("Write a function that returns the n most common words in a text.",
     r"""
     import re
     from collections import Counter

     def top_words(text: str, n: int = 10) -> list[tuple[str, int]]:
         words = re.findall(r"[a-z']+", text.lower())
         return Counter(words).most_common(n)
     """,
     "It lower-cases the text first, so \"The\" and \"the\" count as the same word."),
    ("How do I read all lines of a file into a list, without the trailing newlines?",
     """
     from pathlib import Path

     def read_lines(path) -> list[str]:
         return Path(path).read_text(encoding="utf-8").splitlines()
     """,
     "Unlike `readlines()`, `splitlines()` drops the line endings, and it handles both `\\n` and `\\r\\n`."),
    ("Write a function that merges two sorted lists into one sorted list.",
     """
     def merge_sorted(left: list, right: list) -> list:
         merged, i, j = [], 0, 0
         while i < len(left) and j < len(right):
             if left[i] <= right[j]:
                 merged.append(left[i])
                 i += 1
             else:
                 merged.append(right[j])
                 j += 1
         merged.extend(left[i:])
         merged.extend(right[j:])
         return merged
     """,
     "It takes time proportional to the total length; `heapq.merge` does the same lazily."),
    ("Implement binary search: return the index of a target in a sorted list, or -1 if it is not there.",
     """
     def binary_search(items: list, target) -> int:
         low, high = 0, len(items) - 1
         while low <= high:
             middle = (low + high) // 2
             if items[middle] == target:
                 return middle
             if items[middle] < target:
                 low = middle + 1
             else:
                 high = middle - 1
         return -1
     """,
     "Each step halves the range, so it needs at most about log2(n) comparisons."),
    ("Write a function to convert Celsius to Fahrenheit.",
     """
     def celsius_to_fahrenheit(celsius: float) -> float:
         return celsius * 9 / 5 + 32
     """,
     "`celsius_to_fahrenheit(100)` returns 212.0, and -40 is the same in both scales."),
    ("Write a function that converts snake_case names to camelCase.",
     """
     def snake_to_camel(name: str) -> str:
         first, *rest = name.split("_")
         return first + "".join(word.capitalize() for word in rest)
     """,
     "`snake_to_camel(\"max_retry_count\")` returns `\"maxRetryCount\"`."),
    ("How do I count the lines in a big file without loading it all into memory?",
     """
     def count_lines(path) -> int:
         with open(path, "rb") as file:
             return sum(1 for _ in file)
     """,
     "Iterating over a file reads it one line at a time, and binary mode skips decoding the text."),
    ("Write a function that finds the largest file in a directory tree.",
     """
     from pathlib import Path

     def largest_file(root):
         files = (path for path in Path(root).rglob("*") if path.is_file())
         return max(files, key=lambda path: path.stat().st_size, default=None)
     """,
     "It returns `None` when the tree holds no files."),
    ("Write the Euclidean algorithm for the greatest common divisor.",
     """
     def gcd(a: int, b: int) -> int:
         while b:
             a, b = b, a % b
         return abs(a)
     """,
     "`gcd(48, 18)` returns 6. The standard library has it as `math.gcd`."),
    ("Write a function that transposes a matrix given as a list of lists.",
     """
     def transpose(matrix: list[list]) -> list[list]:
         return [list(row) for row in zip(*matrix)]
     """,
     "`transpose([[1, 2, 3], [4, 5, 6]])` returns `[[1, 4], [2, 5], [3, 6]]`."),
    ("How do I compute a running total of a list of numbers?",
     """
     from itertools import accumulate

     def running_total(numbers) -> list:
         return list(accumulate(numbers))
     """,
     "`running_total([3, 1, 4, 1, 5])` returns `[3, 4, 8, 9, 14]`."),
    ("Write a function that groups words by their first letter.",
     """
     from collections import defaultdict

     def group_by_first_letter(words) -> dict[str, list[str]]:
         groups = defaultdict(list)
         for word in words:
             if word:
                 groups[word[0].lower()].append(word)
         return dict(groups)
     """,
     "Empty strings are skipped, since they have no first letter."),
    ("Write a function that parses lines like `key=value` into a dict, skipping blank lines and comments that "
     "start with #.",
     """
     def parse_settings(text: str) -> dict[str, str]:
         settings = {}
         for line in text.splitlines():
             line = line.strip()
             if not line or line.startswith("#"):
                 continue
             key, separator, value = line.partition("=")
             if not separator:
                 raise ValueError(f"expected key=value, got {line!r}")
             settings[key.strip()] = value.strip()
         return settings
     """,
     "`partition` splits at the first `=` only, so values may contain `=` themselves."),
    ("Write a function that returns the sum of the digits of a non-negative integer.",
     """
     def digit_sum(n: int) -> int:
         total = 0
         while n > 0:
             n, digit = divmod(n, 10)
             total += digit
         return total
     """,
     "`digit_sum(9875)` returns 29."),
    ("Write a function that rotates a list to the right by k positions.",
     """
     def rotate_right(items: list, k: int) -> list:
         if not items:
             return []
         k %= len(items)
         return items[-k:] + items[:-k]
     """,
     "`rotate_right([1, 2, 3, 4, 5], 2)` returns `[4, 5, 1, 2, 3]`, and k larger than the list wraps around."),
    ("How can I check if two words are anagrams of each other?",
     """
     from collections import Counter

     def are_anagrams(first: str, second: str) -> bool:
         return Counter(first.lower()) == Counter(second.lower())
     """,
     "Two words are anagrams when they use the same letters the same number of times, so "
     "`are_anagrams(\"Listen\", \"Silent\")` is `True`."),
    ("Write a decorator that prints how long a function takes.",
     """
     import functools
     import time

     def timed(func):
         @functools.wraps(func)
         def wrapper(*args, **kwargs):
             start = time.perf_counter()
             try:
                 return func(*args, **kwargs)
             finally:
                 elapsed_s = time.perf_counter() - start
                 print(f"{func.__name__} took {elapsed_s:.3f} s")
         return wrapper
     """,
     "`functools.wraps` keeps the wrapped function's name and docstring, and `finally` reports the time even "
     "when the function raises."),
    ("Write a context manager that changes the working directory and changes it back afterwards.",
     """
     import contextlib
     import os

     @contextlib.contextmanager
     def working_directory(path):
         previous = os.getcwd()
         os.chdir(path)
         try:
             yield
         finally:
             os.chdir(previous)
     """,
     "Since Python 3.11 the standard library has the same thing as `contextlib.chdir`."),
    ("How do I write a JSON file so that a crash never leaves a half-written file behind?",
     """
     import json
     import os
     import tempfile

     def write_json_atomically(path, data) -> None:
         directory = os.path.dirname(os.path.abspath(path))
         with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False,
                                          encoding="utf-8") as file:
             json.dump(data, file)
             file.flush()
             os.fsync(file.fileno())
         os.replace(file.name, path)
     """,
     "`os.replace` is atomic when both paths are on the same file system, which is why the temporary file is "
     "created in the target's own directory."),
    ("Write a function that converts a number of seconds to an H:MM:SS string.",
     """
     def format_duration(seconds: int) -> str:
         minutes, seconds = divmod(seconds, 60)
         hours, minutes = divmod(minutes, 60)
         return f"{hours}:{minutes:02d}:{seconds:02d}"
     """,
     "`format_duration(3725)` returns `\"1:02:05\"`."),
    ("Write a clamp function that limits a value to a range.",
     """
     def clamp(value: float, low: float, high: float) -> float:
         if low > high:
             raise ValueError(f"low ({low}) must not be greater than high ({high})")
         return max(low, min(value, high))
     """,
     "`clamp(15, 0, 10)` returns 10 and `clamp(-3, 0, 10)` returns 0."),
    ("Write a function that returns the most common element of a list.",
     """
     from collections import Counter

     def most_common(items: list):
         if not items:
             raise ValueError("most_common() of an empty list")
         return Counter(items).most_common(1)[0][0]
     """,
     "On a tie it returns the element that was seen first."),
    ("Write a function that converts an integer from 1 to 3999 to a Roman numeral.",
     """
     NUMERALS = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
                 (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]

     def to_roman(number: int) -> str:
         if not 1 <= number <= 3999:
             raise ValueError(f"number must be between 1 and 3999, got {number}")
         parts = []
         for value, numeral in NUMERALS:
             count, number = divmod(number, value)
             parts.append(numeral * count)
         return "".join(parts)
     """,
     "The table includes the subtractive pairs such as 900 (CM), so `to_roman(1994)` returns `\"MCMXCIV\"`."),
    ("Write a function that computes the median of a list without the statistics module.",
     """
     def median(numbers: list[float]) -> float:
         if not numbers:
             raise ValueError("median of an empty list")
         ordered = sorted(numbers)
         middle = len(ordered) // 2
         if len(ordered) % 2:
             return ordered[middle]
         return (ordered[middle - 1] + ordered[middle]) / 2
     """,
     "With an even number of values it averages the two middle ones."),
]

BUGS: list[tuple[str, str, str, str]] = [
    # (what goes wrong, buggy code, why, fixed code)
    ("Why does this function remember items from earlier calls?",
     """
     def add_item(item, items=[]):
         items.append(item)
         return items
     """,
     "The default list is created once, when the function is defined, and every call that leaves out `items` "
     "shares that same list. Use `None` as the default and create a new list inside the function:",
     """
     def add_item(item, items=None):
         if items is None:
             items = []
         items.append(item)
         return items
     """),
    ("This should return the sum of 1 to n, but `sum_to(5)` gives 10 instead of 15.",
     """
     def sum_to(n):
         total = 0
         for i in range(1, n):
             total += i
         return total
     """,
     "`range(1, n)` stops before `n`, so the last number is never added. Use `range(1, n + 1)`, or skip the "
     "loop entirely with the formula n(n + 1) / 2:",
     """
     def sum_to(n):
         return n * (n + 1) // 2
     """),
    ("I want to remove all negative numbers, but `remove_negatives([-1, -2, 3])` returns `[-2, 3]`.",
     """
     def remove_negatives(numbers):
         for number in numbers:
             if number < 0:
                 numbers.remove(number)
         return numbers
     """,
     "Removing items from a list while looping over it shifts the remaining items left, so the loop skips the "
     "item right after each removal. Build a new list instead:",
     """
     def remove_negatives(numbers):
         return [number for number in numbers if number >= 0]
     """),
    ("Why does this sometimes return False even when both strings are equal?",
     """
     def same_name(a, b):
         return a is b
     """,
     "`is` tests whether two names refer to the same object, not whether their values are equal. The "
     "interpreter shares some short strings, which hides the bug, but strings built at run time are usually "
     "separate objects. Compare values with `==`:",
     """
     def same_name(a, b):
         return a == b
     """),
    ("`total([1, 2, 3])` raises TypeError: unsupported operand type(s) for +: 'int' and 'NoneType'. Why?",
     """
     def total(numbers):
         if not numbers:
             return 0
         numbers[0] + total(numbers[1:])
     """,
     "The recursive case computes the sum but never returns it, so every call except the base case returns "
     "`None`, and the caller one level up then adds a number to `None`. Add the missing `return`:",
     """
     def total(numbers):
         if not numbers:
             return 0
         return numbers[0] + total(numbers[1:])
     """),
    ("I expected this to print 0, 1 and 2, but it prints 2 three times.",
     """
     callbacks = []
     for i in range(3):
         callbacks.append(lambda: i)
     for callback in callbacks:
         print(callback())
     """,
     "A lambda looks up `i` when it is called, not when it is created, and by then the loop has finished "
     "with `i == 2`. Bind the current value as a default argument:",
     """
     callbacks = []
     for i in range(3):
         callbacks.append(lambda i=i: i)
     for callback in callbacks:
         print(callback())
     """),
    ("My log file only ever contains the last message. What is wrong?",
     """
     def log(message):
         with open("app.log", "w") as file:
             file.write(message + "\\n")
     """,
     "Mode `\"w\"` empties the file every time it is opened, so each call erases the earlier messages. Open "
     "it in append mode instead (or use the `logging` module, which handles this for you):",
     """
     def log(message):
         with open("app.log", "a", encoding="utf-8") as file:
             file.write(message + "\\n")
     """),
    ("Why does this print False?",
     """
     print(0.1 + 0.2 == 0.3)
     """,
     "Floats are stored in binary, and 0.1, 0.2 and 0.3 have no exact binary form, so `0.1 + 0.2` is "
     "`0.30000000000000004`. Compare with a tolerance, or use `decimal.Decimal` when you need exact decimal "
     "arithmetic:",
     """
     import math

     print(math.isclose(0.1 + 0.2, 0.3))  # True
     """),
    ("When I set one cell of my grid, a whole column changes.",
     """
     grid = [[0] * 3] * 3
     grid[0][0] = 1
     print(grid)  # [[1, 0, 0], [1, 0, 0], [1, 0, 0]]
     """,
     "`[row] * 3` repeats a reference to the same inner list three times, so all three rows are one list. "
     "Create a new list for every row:",
     """
     grid = [[0] * 3 for _ in range(3)]
     grid[0][0] = 1
     print(grid)  # [[1, 0, 0], [0, 0, 0], [0, 0, 0]]
     """),
    ("This should shout the name, but it returns it unchanged apart from the \"!\".",
     """
     def shout(name):
         name.upper()
         return name + "!"
     """,
     "Strings are immutable: `upper()` returns a new string and leaves `name` alone, and here the result is "
     "thrown away. Use the returned value:",
     """
     def shout(name):
         return name.upper() + "!"
     """),
    ("This raises RuntimeError: dictionary changed size during iteration.",
     """
     def drop_empty(settings):
         for key in settings:
             if not settings[key]:
                 del settings[key]
         return settings
     """,
     "A dict cannot gain or lose keys while you iterate over it. Build a new dict with the entries you want "
     "to keep:",
     """
     def drop_empty(settings):
         return {key: value for key, value in settings.items() if value}
     """),
    ("This still crashes with a TypeError when the value is None.",
     """
     def parse(value):
         try:
             return int(value)
         except ValueError or TypeError:
             return None
     """,
     "`ValueError or TypeError` is an ordinary expression that evaluates to `ValueError`, so only that "
     "exception is caught. Several exception types go in a tuple:",
     """
     def parse(value):
         try:
             return int(value)
         except (ValueError, TypeError):
             return None
     """),
    ("After this code runs, `names` is None.",
     """
     names = ["carol", "alice", "bob"]
     names = names.sort()
     """,
     "`list.sort()` sorts the list in place and returns `None`, which then replaces your list. Either call "
     "`names.sort()` on its own line, or use `sorted`, which returns a new list:",
     """
     names = ["carol", "alice", "bob"]
     names = sorted(names)
     """),
    ("Calling `counter.increment()` raises TypeError: Counter.increment() takes 0 positional arguments but 1 "
     "was given.",
     """
     class Counter:
         def __init__(self):
             self.count = 0

         def increment():
             self.count += 1
     """,
     "Python passes the instance as the first argument of every method call, so the method needs a "
     "parameter for it, by convention `self`:",
     """
     class Counter:
         def __init__(self):
             self.count = 0

         def increment(self):
             self.count += 1
     """),
    ("This says every command is valid, even \"jump\".",
     """
     def is_valid(command):
         return command == "start" or "stop"
     """,
     "Python reads this as `(command == \"start\") or \"stop\"`, and the non-empty string `\"stop\"` is "
     "always true. Test membership in the set of valid commands:",
     """
     def is_valid(command):
         return command in ("start", "stop")
     """),
    ("This raises UnboundLocalError.",
     """
     count = 0

     def increment():
         count += 1
     """,
     "Assigning to `count` inside the function makes it a local variable for the whole function, so "
     "`count += 1` reads a local that has no value yet. Declare it `global`, or better, pass the value in and "
     "return the new one:",
     """
     def increment(count):
         return count + 1

     count = 0
     count = increment(count)
     """),
    ("`average(4, 8)` should be 6 but returns 8.0.",
     """
     def average(a, b):
         return a + b / 2
     """,
     "Division binds tighter than addition, so this computes `a + (b / 2)`. Add parentheses:",
     """
     def average(a, b):
         return (a + b) / 2
     """),
    ("This raises TypeError: can only concatenate str (not \"int\") to str.",
     """
     age = input("Your age: ")
     print("Next year you will be", age + 1)
     """,
     "`input()` always returns a string, and Python does not convert between strings and numbers on its own. "
     "Convert the answer with `int()` first:",
     """
     age = int(input("Your age: "))
     print("Next year you will be", age + 1)
     """),
    ("`count_words(\"hello  world\")` returns 3 instead of 2.",
     """
     def count_words(text):
         return len(text.split(" "))
     """,
     "`split(\" \")` splits at every single space, so two spaces in a row produce an empty string between "
     "them. `split()` without an argument splits on runs of whitespace and ignores it at both ends:",
     """
     def count_words(text):
         return len(text.split())
     """),
    ("`is_prime(9)` returns True.",
     """
     def is_prime(n):
         if n < 2:
             return False
         for divisor in range(2, n):
             if n % divisor == 0:
                 return False
             else:
                 return True
     """,
     "The `else` branch returns after trying only the first divisor, 2, so every odd number counts as prime "
     "(and `is_prime(2)` falls off the end and returns `None`). Return `True` only after the loop has tried "
     "every divisor:",
     """
     def is_prime(n):
         if n < 2:
             return False
         for divisor in range(2, int(n ** 0.5) + 1):
             if n % divisor == 0:
                 return False
         return True
     """),
    ("Why does `sum(squares)` give 0 here?",
     """
     squares = map(lambda x: x * x, [1, 2, 3])
     for square in squares:
         print(square)
     print(sum(squares))
     """,
     "`map` returns an iterator, which can be used up only once: the loop consumed every value, so `sum` "
     "sees an empty iterator. Make a list when you need the values more than once:",
     """
     squares = [x * x for x in [1, 2, 3]]
     for square in squares:
         print(square)
     print(sum(squares))  # 14
     """),
    ("This raises KeyError on the very first word.",
     """
     def count(words):
         counts = {}
         for word in words:
             counts[word] += 1
         return counts
     """,
     "`counts[word] += 1` reads `counts[word]` before writing it, and the key does not exist yet. Start from "
     "a default with `dict.get` (or use `collections.Counter`):",
     """
     def count(words):
         counts = {}
         for word in words:
             counts[word] = counts.get(word, 0) + 1
         return counts
     """),
    ("`\"report.txt\".rstrip(\".txt\")` gives `\"repor\"`, not `\"report\"`.",
     """
     name = "report.txt".rstrip(".txt")
     """,
     "`rstrip` takes a set of characters, not a suffix: it removes any trailing `.`, `t` or `x`, which also "
     "eats the last `t` of `report`. Since Python 3.9, `removesuffix` removes an exact suffix:",
     """
     name = "report.txt".removesuffix(".txt")
     """),
    ("`largest([3, 9, 4, 12])` returns 9.",
     """
     def largest(numbers):
         best = numbers[0]
         for i in range(len(numbers) - 1):
             if numbers[i] > best:
                 best = numbers[i]
         return best
     """,
     "`range(len(numbers) - 1)` stops one index early, so the last element is never compared. Loop over the "
     "items themselves, which avoids the index arithmetic (or simply call the built-in `max`):",
     """
     def largest(numbers):
         best = numbers[0]
         for number in numbers[1:]:
             if number > best:
                 best = number
         return best
     """),
]

FUNCTION_INTROS = ["", "Here is one way to do it:\n\n", "Here is a short version:\n\n"]
BUG_OPENINGS = ["", "Can you help me fix this? ", "What's wrong with my code? "]


def code_conversations() -> list[list[Message]]:
    conversations = []
    for index, (name, answer) in enumerate(STDLIB):
        question = STDLIB_QUESTIONS[index % len(STDLIB_QUESTIONS)].format(name=name)
        system = CODE_SYSTEM_PROMPTS[index % len(CODE_SYSTEM_PROMPTS)] if index % 3 == 2 else None
        conversations.append(messages_of([(question, answer)], system))
    for index, (request, code, note) in enumerate(FUNCTIONS):
        answer = FUNCTION_INTROS[index % len(FUNCTION_INTROS)] + python_block(code) + "\n\n" + note
        system = CODE_SYSTEM_PROMPTS[index % len(CODE_SYSTEM_PROMPTS)] if index % 3 == 0 else None
        conversations.append(messages_of([(request, answer)], system))
    for index, (problem, buggy, why, fixed) in enumerate(BUGS):
        question = BUG_OPENINGS[index % len(BUG_OPENINGS)] + problem + "\n\n" + python_block(buggy)
        system = CODE_SYSTEM_PROMPTS[0] if index % 4 == 3 else None
        conversations.append(messages_of([(question, why + "\n\n" + python_block(fixed))], system))
    return conversations


# --- math: problems whose answers are computed here ----------------------------------------------------

MATH_SYSTEM_PROMPTS = [
    "You are a careful math tutor. Show each step of your working.",
    "You are a helpful assistant. Explain your reasoning briefly.",
]


def multiplication(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(12, 99), rng.choice([n for n in range(13, 100) if n % 10])
    tens, ones = b - b % 10, b % 10
    question = rng.choice(["What is {a} × {b}?", "Compute {a} * {b}.", "Multiply {a} by {b}."]).format(a=a, b=b)
    answer = (f"Split {b} into {tens} + {ones}. Then {a} × {tens} = {a * tens} and {a} × {ones} = {a * ones}. "
              f"Adding the two gives {a * tens} + {a * ones} = {a * b}, so {a} × {b} = {a * b}.")
    return question, answer


def percent_of(rng: random.Random) -> tuple[str, str]:
    percent, whole = rng.choice([5, 10, 12, 15, 20, 25, 30, 35, 40, 45, 60, 75, 80]), rng.randint(2, 90) * 10
    part = Fraction(percent * whole, 100)
    question = rng.choice(["What is {p}% of {n}?", "Calculate {p} percent of {n}."]).format(p=percent, n=whole)
    answer = (f"{percent}% means {percent} out of every 100, so {percent}% of {whole} is "
              f"{percent} / 100 × {whole} = {decimal_text(part)}.")
    return question, answer


def discount(rng: random.Random) -> tuple[str, str]:
    price, percent = rng.randint(20, 300), rng.choice([10, 15, 20, 25, 30, 40, 50])
    item = rng.choice(["jacket", "pair of shoes", "lamp", "backpack", "chair", "watch", "board game"])
    saving_cents = price * percent  # price * 100 cents * percent / 100
    question = (f"A {item} costs ${price} and is on sale at {percent}% off. How much do I save, and what is the "
                "sale price?")
    answer = (f"The saving is {percent}% of ${price}: {price} × {percent} / 100 = {money(saving_cents)}. "
              f"The sale price is ${price} - {money(saving_cents)} = {money(price * 100 - saving_cents)}.")
    return question, answer


def change(rng: random.Random) -> tuple[str, str]:
    singular, plural = rng.choice([("notebook", "notebooks"), ("pen", "pens"), ("coffee", "coffees"),
                                   ("sandwich", "sandwiches"), ("ticket", "tickets"), ("candle", "candles"),
                                   ("postcard", "postcards"), ("muffin", "muffins")])
    count, price_cents = rng.randint(2, 9), rng.randrange(125, 1000, 5)
    total_cents = count * price_cents
    note_dollars = min(note for note in (20, 50, 100) if note * 100 >= total_cents)
    note_cents = note_dollars * 100
    question = (f"I buy {count} {plural} at {money(price_cents)} each and pay with a ${note_dollars} note. How "
                "much change do I get?")
    answer = (f"The {plural} cost {count} × {money(price_cents)} = {money(total_cents)}. The change is "
              f"{money(note_cents)} - {money(total_cents)} = {money(note_cents - total_cents)}.")
    return question, answer


def speed_distance_time(rng: random.Random) -> tuple[str, str]:
    speed_kmh = rng.randrange(40, 121, 2)
    hours = rng.choice([Fraction(1, 2), Fraction(3, 2), Fraction(2), Fraction(5, 2), Fraction(3), Fraction(4)])
    distance_km = speed_kmh * hours
    vehicle, hours_text = rng.choice(["train", "car", "bus", "coach"]), decimal_text(hours)
    unit = "hour" if hours == 1 else "hours"
    variant = rng.randrange(3)
    if variant == 0:
        question = f"A {vehicle} travels {distance_km} km in {hours_text} {unit}. What is its average speed?"
        answer = (f"Average speed is distance divided by time: {distance_km} km / {hours_text} h = "
                  f"{speed_kmh} km/h.")
    elif variant == 1:
        question = f"A {vehicle} drives at a steady {speed_kmh} km/h for {hours_text} {unit}. How far does it go?"
        answer = f"Distance is speed times time: {speed_kmh} km/h × {hours_text} h = {distance_km} km."
    else:
        question = f"How long does a {vehicle} take to cover {distance_km} km at {speed_kmh} km/h?"
        whole_hours, minutes = divmod(int(hours * 60), 60)
        if not minutes:
            clock = ""
        elif whole_hours:
            clock = f", which is {whole_hours} h {minutes} min"
        else:
            clock = f", which is {minutes} minutes"
        answer = (f"Time is distance divided by speed: {distance_km} km / {speed_kmh} km/h = {hours_text} "
                  f"{unit}{clock}.")
    return question, answer


def linear_equation(rng: random.Random) -> tuple[str, str]:
    a, x, b = rng.randint(2, 12), rng.randint(-15, 20), rng.choice([n for n in range(-30, 31) if n])
    c = a * x + b
    sign = "+" if b > 0 else "-"
    question = f"Solve for x: {a}x {sign} {abs(b)} = {c}."
    if b > 0:
        isolate = f"Subtract {b} from both sides: {a}x = {c} - {b} = {c - b}."
    else:
        isolate = f"Add {-b} to both sides: {a}x = {c} + {-b} = {c - b}."
    x_text = f"({x})" if x < 0 else str(x)
    answer = (f"{isolate} Divide both sides by {a}: x = {c - b} / {a} = {x}. "
              f"Check: {a} × {x_text} {sign} {abs(b)} = {c}.")
    return question, answer


def mean(rng: random.Random) -> tuple[str, str]:
    numbers = [rng.randint(1, 100) for _ in range(rng.choice([4, 5]))]
    listed = ", ".join(map(str, numbers[:-1])) + f" and {numbers[-1]}"
    total = sum(numbers)
    question = rng.choice(["What is the average of {listed}?", "Find the mean of {listed}."]).format(listed=listed)
    answer = (f"Add them up: {' + '.join(map(str, numbers))} = {total}. There are {len(numbers)} numbers, so "
              f"the mean is {total} / {len(numbers)} = {decimal_text(Fraction(total, len(numbers)))}.")
    return question, answer


def adding_fractions(rng: random.Random) -> tuple[str, str]:
    first_denominator, second_denominator = rng.sample(range(2, 13), 2)
    first = Fraction(rng.choice([n for n in range(1, first_denominator) if math.gcd(n, first_denominator) == 1]),
                     first_denominator)
    second = Fraction(rng.choice([n for n in range(1, second_denominator)
                                  if math.gcd(n, second_denominator) == 1]), second_denominator)
    common = math.lcm(first.denominator, second.denominator)
    first_scaled = first.numerator * (common // first.denominator)
    second_scaled = second.numerator * (common // second.denominator)
    total = first + second
    question = f"What is {first} + {second}?"
    answer = (f"The least common denominator of {first.denominator} and {second.denominator} is {common}. "
              f"Rewrite both fractions: {first} = {first_scaled}/{common} and {second} = {second_scaled}/{common}. "
              f"Add the numerators: {first_scaled}/{common} + {second_scaled}/{common} = "
              f"{first_scaled + second_scaled}/{common}.")
    divisor = math.gcd(first_scaled + second_scaled, common)
    if divisor > 1:
        answer += f" Dividing top and bottom by {divisor} simplifies it to {total}."
    if total > 1 and total.denominator > 1:
        whole, rest = divmod(total.numerator, total.denominator)
        answer += f" As a mixed number that is {whole} {rest}/{total.denominator}."
    return question, answer


def ages(rng: random.Random) -> tuple[str, str]:
    name, possessive, relative = rng.choice([("Nora", "her", "daughter"), ("Sam", "his", "son"),
                                             ("Priya", "her", "nephew"), ("Omar", "his", "niece"),
                                             ("Elena", "her", "son"), ("David", "his", "daughter")])
    multiple, younger = rng.randint(3, 6), rng.randint(4, 14)
    while multiple * younger < 26:  # an adult and a child
        younger += 1
    older, together = multiple * younger, (multiple + 1) * younger
    question = (f"{name} is {multiple} times as old as {possessive} {relative}. Together they are {together} "
                "years old. How old is each of them?")
    answer = (f"Let the {relative}'s age be y. Then {name} is {multiple}y, so y + {multiple}y = {multiple + 1}y "
              f"= {together}. That gives y = {together} / {multiple + 1} = {younger}: the {relative} is "
              f"{younger} and {name} is {multiple} × {younger} = {older}. Check: {younger} + {older} = {together}.")
    return question, answer


def gcd_and_lcm(rng: random.Random) -> tuple[str, str]:
    divisor = rng.randint(2, 15)
    m, n = rng.choice([(m, n) for m in range(2, 16) for n in range(2, 16) if m > n and math.gcd(m, n) == 1])
    first, second = divisor * m, divisor * n
    steps, a, b = [], first, second
    while b:
        quotient, remainder = divmod(a, b)
        steps.append(f"{a} = {quotient} × {b} + {remainder}")
        a, b = b, remainder
    assert a == math.gcd(first, second) == divisor
    lcm = first * second // divisor
    question = f"Find the greatest common divisor and the least common multiple of {first} and {second}."
    answer = (f"Use the Euclidean algorithm: {'; '.join(steps)}. The last non-zero remainder is {divisor}, so "
              f"gcd({first}, {second}) = {divisor}. Then lcm = {first} × {second} / {divisor} = "
              f"{first * second} / {divisor} = {lcm}.")
    return question, answer


def rectangle(rng: random.Random) -> tuple[str, str]:
    length, width = sorted(rng.sample(range(3, 41), 2), reverse=True)
    thing = rng.choice(["garden", "room", "field", "car park", "swimming pool"])
    question = f"A rectangular {thing} is {length} m long and {width} m wide. What are its area and perimeter?"
    answer = (f"Area = length × width = {length} × {width} = {length * width} m². Perimeter = 2 × (length + "
              f"width) = 2 × ({length} + {width}) = {2 * (length + width)} m.")
    return question, answer


def seconds_to_clock(rng: random.Random) -> tuple[str, str]:
    seconds = rng.randint(3700, 86000)
    hours, rest = divmod(seconds, 3600)
    minutes, left = divmod(rest, 60)
    question = f"How many hours, minutes and seconds are {seconds} seconds?"
    answer = (f"An hour has 3600 seconds, and {seconds} / 3600 = {hours} with {rest} left over. A minute has 60 "
              f"seconds, and {rest} / 60 = {minutes} with {left} left over. So {seconds} seconds is {hours} h "
              f"{minutes} min {left} s.")
    return question, answer


MATH_PROBLEMS: list[tuple[Callable[[random.Random], tuple[str, str]], int]] = [
    # (problem maker, how many)
    (multiplication, 6), (percent_of, 5), (discount, 5), (change, 6), (speed_distance_time, 6),
    (linear_equation, 7), (mean, 5), (adding_fractions, 6), (ages, 5), (gcd_and_lcm, 5), (rectangle, 4),
    (seconds_to_clock, 4),
]


def math_conversations(rng: random.Random) -> list[list[Message]]:
    conversations, seen = [], set()
    for make_problem, count in MATH_PROBLEMS:
        made = 0
        while made < count:
            question, answer = make_problem(rng)
            if question in seen:
                continue
            seen.add(question)
            index = len(conversations)
            system = MATH_SYSTEM_PROMPTS[index // 4 % 2] if index % 4 == 0 else None
            conversations.append(messages_of([(question, answer)], system))
            made += 1
    return conversations


# --- multi-turn: follow-up questions -------------------------------------------------------------------

MULTI_TURN_SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Keep answers short and to the point.",
    "You are an experienced software engineer who answers questions from colleagues.",
]

THREADS: list[Pairs] = [
    [("How do I read a CSV file in Python?",
      "Use the `csv` module from the standard library:\n\n"
      + python_block("""
        import csv

        with open("data.csv", newline="", encoding="utf-8") as file:
            for row in csv.reader(file):
                print(row)
        """)
      + "\n\nEach `row` is a list of strings, one per column."),
     ("My file has a header row. How do I skip it?",
      "Call `next()` on the reader once before the loop: `header = next(reader)`. That also keeps the column "
      "names in case you need them. Alternatively, `csv.DictReader` reads the header for you and yields each "
      "row as a dict keyed by column name."),
     ("How do I add up the values in the \"amount\" column?",
      "With `DictReader`, convert each value to a number as you go:\n\n"
      + python_block("""
        import csv

        with open("data.csv", newline="", encoding="utf-8") as file:
            total = sum(float(row["amount"]) for row in csv.DictReader(file))
        print(total)
        """)
      + "\n\nUse `decimal.Decimal` instead of `float` if the amounts are money and you need exact cents.")],
    [("I want to learn to cook. Where should I start?",
      "Start with a handful of simple dishes you actually like to eat, and cook each one several times until it "
      "feels easy. Learn a few basic techniques along the way: chopping an onion, boiling pasta, frying an egg, "
      "roasting vegetables. A sharp knife, a cutting board, one good pan and one pot go a long way."),
     ("What is a good first dish?",
      "A tomato pasta sauce is a great first dish. Soften a chopped onion and some garlic in olive oil, add a "
      "can of tomatoes and a pinch of salt, and let it simmer for 15 to 20 minutes while the pasta cooks. It "
      "teaches chopping, gentle frying, simmering and seasoning, and it is hard to ruin."),
     ("How do I know when the pasta is done?",
      "Start tasting a piece a minute or two before the time on the packet. It is done when it is tender but "
      "still has a slight bite in the centre, which Italians call al dente. Save a cup of the cooking water "
      "before draining: a splash of it helps the sauce cling to the pasta.")],
    [("How do I undo my last git commit?",
      "If you have not pushed it yet, `git reset --soft HEAD~1` removes the commit but keeps its changes "
      "staged, so you can fix them and commit again. `git reset --hard HEAD~1` removes the commit and throws "
      "its changes away, so use that only when you are sure."),
     ("What if I already pushed it?",
      "Then do not rewrite history that others may have pulled. Use `git revert HEAD` instead: it creates a new "
      "commit that undoes the changes of the last one, and you push it like any other commit."),
     ("So what is the difference between reset and revert?",
      "`git reset` moves your branch back, so the commits after that point disappear from the branch: it "
      "rewrites history. `git revert` leaves history alone and adds a new commit with the opposite changes. "
      "Reset is fine for local, unpushed work; revert is the safe choice on shared branches.")],
    [("What is the difference between a list and a tuple in Python?",
      "A list is mutable: you can append, remove and replace its items. A tuple is immutable: once created, its "
      "items cannot be replaced. Both are ordered sequences that support indexing, slicing and iteration."),
     ("When would I pick a tuple?",
      "Use a tuple for a fixed group of values that belong together, like a coordinate `(x, y)` or several "
      "values returned from a function. Because tuples are immutable, they can be dict keys and set members "
      "when all their items are hashable, which lists never can."),
     ("Can a tuple contain a list?",
      "Yes. The tuple cannot change which objects it holds, but a list inside it is still mutable, so "
      "`t = ([1], 2)` followed by `t[0].append(3)` works. Such a tuple is not hashable, though, so it cannot be "
      "a dict key.")],
    [("I get a KeyError when I read from a dictionary. What does it mean?",
      "A `KeyError` means you asked for a key that is not in the dictionary, for example `config[\"port\"]` "
      "when `config` has no `\"port\"` entry. The error message shows the missing key, which usually points "
      "straight at a typo or at data that never arrived."),
     ("How can I avoid it?",
      "If a missing key is normal, use `config.get(\"port\", 8080)`, which returns the default instead of "
      "raising. You can also check first with `if \"port\" in config:`. If the key must be there, let the "
      "error happen, or raise a clearer one that says which key is missing and where it should come from."),
     ("What about nested dictionaries?",
      "Chain `get` calls with an empty dict as the default for the inner levels: "
      "`config.get(\"server\", {}).get(\"port\", 8080)`. For deep or irregular data it is often cleaner to "
      "validate the structure once, where you load it, than to guard every access.")],
    [("How do I create a virtual environment?",
      "Run `python -m venv .venv` in your project folder. It creates a `.venv` directory with its own Python "
      "interpreter and its own `site-packages`, so packages you install there do not affect the rest of your "
      "system."),
     ("How do I activate it?",
      "On Linux and macOS, run `source .venv/bin/activate`; on Windows, run `.venv\\Scripts\\activate`. Your "
      "prompt then shows the environment's name, and `python` and `pip` refer to the ones inside `.venv`."),
     ("And how do I install my project's dependencies into it?",
      "With the environment active, run `pip install -r requirements.txt`. If your project has a "
      "`pyproject.toml`, `pip install -e .` installs the project itself in editable mode, along with its "
      "dependencies."),
     ("How do I leave it again?",
      "Type `deactivate`. Your shell goes back to the system Python; the environment stays on disk, and you "
      "can activate it again at any time.")],
    [("Write a function that counts how often each word appears in a text.",
      python_block("""
        from collections import Counter

        def word_counts(text: str) -> Counter:
            return Counter(text.split())
        """)
      + "\n\n`Counter` maps each word to the number of times it appears."),
     ("It counts \"The\" and \"the\" separately. Can you fix that?",
      "Lower-case the text before splitting it:\n\n"
      + python_block("""
        def word_counts(text: str) -> Counter:
            return Counter(text.lower().split())
        """)),
     ("Punctuation sticks to the words too, like \"end.\". Can you handle that?",
      "Pick out the words with a regular expression instead of splitting on whitespace:\n\n"
      + python_block(r"""
        import re
        from collections import Counter

        def word_counts(text: str) -> Counter:
            return Counter(re.findall(r"[a-z0-9']+", text.lower()))
        """)),
     ("Now return only the three most common words.",
      "`Counter.most_common` does that:\n\n"
      + python_block("""
        def top_three(text: str) -> list[tuple[str, int]]:
            return word_counts(text).most_common(3)
        """)
      + "\n\nIt returns a list of `(word, count)` pairs, most frequent first.")],
    [("What is the difference between GET and POST requests?",
      "A GET request asks the server for a resource and sends its parameters in the URL; it should not change "
      "anything on the server. A POST request sends data in the request body, usually to create something or "
      "trigger an action. GET requests can be cached, bookmarked and safely repeated; POST requests generally "
      "cannot."),
     ("Which one should a search form use?",
      "GET. A search only reads data, and with GET the query ends up in the URL, so people can bookmark a "
      "search, share it, or go back to it without the browser warning about resubmitting a form."),
     ("Is POST more secure than GET then?",
      "Not by itself. POST keeps the data out of the URL, so it does not end up in browser history or server "
      "logs as easily, which is why passwords are sent with POST. But the body is just as readable on the "
      "network as the URL: only HTTPS encrypts the request.")],
    [("What is a training set?",
      "The training set is the part of your data the model learns from: its parameters are adjusted to make "
      "good predictions on exactly these examples."),
     ("And a validation set?",
      "The validation set is data held back from training that you use to make decisions: choosing "
      "hyperparameters, comparing models, deciding when to stop training. Because you look at its results "
      "again and again, your choices slowly adapt to it."),
     ("Then why do I need a test set as well?",
      "Since the validation set influenced your decisions, its score is slightly optimistic. The test set is "
      "kept aside until the very end and used once, to estimate how the final model does on data that never "
      "influenced it. If you tune on the test set, it stops being an honest estimate.")],
    [("I want to get better at chess. Any advice?",
      "Play longer games, at least 15 minutes per side, so you have time to think, and review each game "
      "afterwards, especially the losses. Solve a few tactics puzzles every day: most games between club "
      "players are decided by tactics, not deep strategy."),
     ("Should I memorize openings?",
      "Not much at first. Learn the principles instead: control the centre, develop your knights and bishops, "
      "castle early, and do not move the same piece twice in the opening without a reason. One simple opening "
      "for White and a reply each to 1.e4 and 1.d4 are plenty for a long time."),
     ("How do I stop blundering pieces?",
      "Before every move, ask two questions: what does my opponent's last move threaten, and after my move, "
      "which of my pieces are undefended or can be captured? This check feels slow at first, but it quickly "
      "becomes a habit.")],
    [("How do I match a date like 2024-05-01 with a regular expression?",
      "`\\d{4}-\\d{2}-\\d{2}` matches four digits, a dash, two digits, a dash and two digits. Use "
      "`re.fullmatch` if the whole string must be a date, or `re.search` to find one inside a longer text."),
     ("How do I get the year, month and day out of it?",
      "Put each part in a named group:\n\n"
      + python_block(r"""
        import re

        match = re.fullmatch(r"(?P<year>\d{4})-(?P<month>\d{2})-(?P<day>\d{2})", "2024-05-01")
        print(match["year"], match["month"], match["day"])  # 2024 05 01
        """)),
     ("The pattern accepts 2024-13-45. How do I reject impossible dates?",
      "A regular expression only checks the shape, not the calendar. Parse the string with "
      "`datetime.date.fromisoformat`, which raises `ValueError` for impossible dates, including February 30. "
      "Keep the regular expression only for finding dates inside longer text.")],
    [("How do I sort a list of dicts by the \"age\" key?",
      "Pass a key function to `sorted`: `sorted(people, key=lambda person: person[\"age\"])`. "
      "`operator.itemgetter(\"age\")` does the same and is slightly faster."),
     ("And oldest first?",
      "Add `reverse=True`: `sorted(people, key=lambda person: person[\"age\"], reverse=True)`."),
     ("If two people have the same age, I want them sorted by name.",
      "Return a tuple from the key function; tuples compare item by item: "
      "`sorted(people, key=lambda person: (person[\"age\"], person[\"name\"]))`. For oldest first but names "
      "still from A to Z, negate the number: `key=lambda person: (-person[\"age\"], person[\"name\"])`.")],
    [("Can you help me write a subject line for an email asking my manager for a day off?",
      "Keep it short and specific, for example: \"Day off request: Friday, 14 June\". It tells your manager "
      "what the email is about, and which date, before they even open it."),
     ("How should the email itself start?",
      "Get to the point in the first sentence: \"Hi Sam, I would like to take Friday, 14 June off.\" Then add "
      "a line on how your work will be covered, such as a handover or a deadline you will meet beforehand, and "
      "close with a thank you."),
     ("Should I say why I need the day?",
      "Usually not. Ordinary leave needs no reason, and a simple request reads more confidently than a long "
      "explanation. If the timing is awkward, a short reason can help, but keep it to one sentence.")],
    [("What is a draft model in speculative decoding?",
      "A draft model is a small, fast model that guesses the next few tokens a large target model would "
      "produce. The target model then checks all of those guesses in one forward pass instead of generating "
      "them one at a time."),
     ("Why does that make generation faster?",
      "Generating with a large model is usually limited by reading its weights from memory, not by arithmetic, "
      "so checking several tokens in one pass costs about as much as generating one. Every accepted guess is a "
      "token gained almost for free. With the standard acceptance rule, the output follows exactly the target "
      "model's distribution, so quality does not change."),
     ("What decides how much faster it gets?",
      "Mainly the acceptance rate: how often the target agrees with the draft's guesses. A high rate means "
      "long runs of accepted tokens per target pass. The draft must also be cheap, because its own time is "
      "added to every step."),
     ("What is special about EAGLE drafters?",
      "EAGLE drafters do not read just the tokens: they also take the target model's own hidden states as "
      "input, so they predict from the target's internal features. EAGLE-3 combines hidden states from a low, "
      "a middle and a high layer of the target, and during training it feeds its own predictions back in, as "
      "it will when drafting. That makes its guesses match the target far more often than an independent "
      "small model.")],
    [("How do I write a test with pytest?",
      "Create a file whose name starts with `test_`, write functions whose names start with `test_`, and use "
      "plain `assert`:\n\n"
      + python_block("""
        from mymodule import add

        def test_add():
            assert add(2, 3) == 5
        """)
      + "\n\nRun `pytest` in the project folder and it finds and runs them."),
     ("How do I run just one test?",
      "Give pytest the file and the test name: `pytest tests/test_math.py::test_add`. You can also select tests "
      "by part of their name with `-k`, for example `pytest -k add`."),
     ("How do I test that a function raises an exception?",
      "Use `pytest.raises` as a context manager:\n\n"
      + python_block("""
        import pytest

        def test_divide_by_zero():
            with pytest.raises(ZeroDivisionError):
                1 / 0
        """)
      + "\n\nPass `match=\"...\"` to also check the error message against a regular expression.")],
    [("What does `async def` do in Python?",
      "`async def` defines a coroutine function. Calling it does not run the body; it returns a coroutine "
      "object that runs when an event loop drives it, and inside it you can use `await` to pause until other "
      "asynchronous work is done."),
     ("How do I actually run one?",
      "From ordinary code, pass it to `asyncio.run`:\n\n"
      + python_block("""
        import asyncio

        async def main():
            await asyncio.sleep(1)
            print("done")

        asyncio.run(main())
        """)
      + "\n\nInside another coroutine, just `await` it."),
     ("How do I run two of them at the same time?",
      "Use `asyncio.gather`, which runs them concurrently and returns their results in order: "
      "`results = await asyncio.gather(fetch(\"a\"), fetch(\"b\"))`. They overlap while waiting on I/O, but "
      "they still share one thread, so CPU-heavy work does not get faster this way.")],
    [("How big can an integer be in Python?",
      "As big as your memory allows. Python's `int` grows automatically, so `2 ** 1000` is computed exactly, "
      "with all 302 digits. Very large numbers just get slower to work with."),
     ("Is that true for floats too?",
      "No. A `float` is a 64-bit IEEE 754 number: about 15 to 17 significant digits, with a largest value near "
      "1.8e308. Beyond that you get `inf`, and many decimal fractions, such as 0.1, cannot be stored "
      "exactly."),
     ("How do I get exact decimal results, for money for example?",
      "Use `decimal.Decimal`, and create values from strings: `Decimal(\"0.1\") + Decimal(\"0.2\")` is exactly "
      "`Decimal(\"0.3\")`. For money you can also store whole cents as integers, and `fractions.Fraction` gives "
      "exact rational arithmetic when you need it.")],
    [("How do I list the files in a folder?",
      "With `pathlib`: `[path for path in Path(\"docs\").iterdir() if path.is_file()]`. `iterdir()` yields "
      "every entry in the folder, subfolders included, so the `is_file()` check keeps just the files."),
     ("Only the .txt files, please.",
      "Use `glob` with a pattern: `list(Path(\"docs\").glob(\"*.txt\"))`."),
     ("And the ones in subfolders as well?",
      "Switch to `rglob`, which searches the whole tree: `list(Path(\"docs\").rglob(\"*.txt\"))`. Wrap it in "
      "`sorted(...)` if you want a stable order, since the file system does not guarantee one.")],
    [("How do I make pancakes?",
      "Whisk 200 g of flour, 2 teaspoons of baking powder, a pinch of salt and a spoonful of sugar. In another "
      "bowl, mix 250 ml of milk, one egg and 2 tablespoons of melted butter, then stir it into the dry mix "
      "until just combined; a few lumps are fine. Cook ladlefuls in a lightly buttered pan over medium heat, "
      "and flip them when bubbles appear on the surface."),
     ("Can I make them without eggs?",
      "Yes. Leave the egg out and add 2 or 3 extra tablespoons of milk, or replace it with half a mashed banana "
      "or 3 tablespoons of yogurt. The baking powder does most of the rising anyway, so they still come out "
      "fluffy."),
     ("How do I keep them warm while I cook the rest?",
      "Put the finished pancakes on a plate in the oven at about 90 degrees Celsius, loosely covered with foil "
      "so they do not dry out. Stack them rather than spreading them out; they keep each other warm.")],
    [("How do I get the current time in UTC in Python?",
      "Call `datetime.now(timezone.utc)`, with both names imported from `datetime`. It returns an aware "
      "datetime, one that knows its time zone, which avoids many of the bugs that naive datetimes cause."),
     ("How do I convert it to another time zone?",
      "Use `zoneinfo` (Python 3.9 and later) and `astimezone`:\n\n"
      + python_block("""
        from datetime import datetime, timezone
        from zoneinfo import ZoneInfo

        now = datetime.now(timezone.utc)
        print(now.astimezone(ZoneInfo("Europe/Berlin")))
        """)),
     ("How do I turn it into a string for an API?",
      "Call `isoformat()`: it gives something like `2024-05-01T14:30:00+02:00`, including the UTC offset. "
      "`datetime.fromisoformat` reads the same format back.")],
    [("How do I define a dataclass?",
      "Decorate a class with `@dataclass` and list its fields with type annotations:\n\n"
      + python_block("""
        from dataclasses import dataclass

        @dataclass
        class Point:
            x: float
            y: float
        """)
      + "\n\nYou get `__init__`, `__repr__` and `__eq__` for free."),
     ("How do I give a field a default empty list?",
      "Use `field(default_factory=list)`. A plain `tags: list = []` raises `ValueError`, because one list "
      "would be shared by every instance:\n\n"
      + python_block("""
        from dataclasses import dataclass, field

        @dataclass
        class Post:
            title: str
            tags: list[str] = field(default_factory=list)
        """)),
     ("Can I make instances immutable?",
      "Yes, with `@dataclass(frozen=True)`. Assigning to a field then raises "
      "`dataclasses.FrozenInstanceError`, and instances become hashable when all their fields are, so they "
      "can be used as dict keys.")],
    [("My Python script uses a lot of memory when it processes a big file. Why?",
      "Most likely it reads the whole file at once, for example with `read()` or `readlines()`, or it builds a "
      "large list of results. Everything is then held in memory at the same time, and Python objects carry "
      "overhead, so a 1 GB text file can take several GB as a list of strings."),
     ("How can I process it without loading everything?",
      "Iterate over the file object, which reads one line at a time, and handle each line before moving on:\n\n"
      + python_block("""
        with open("big.log", encoding="utf-8") as file:
            num_errors = sum(1 for line in file if "ERROR" in line)
        """)
      + "\n\nGenerators let you chain such steps without building lists in between."),
     ("How do I measure how much memory it uses?",
      "`tracemalloc` from the standard library tracks Python's allocations: call `tracemalloc.start()`, run "
      "your code, then `tracemalloc.get_traced_memory()` returns the current and peak sizes in bytes. For the "
      "whole process, including C extensions, look at the peak resident size, for example with "
      "`/usr/bin/time -v`.")],
    [("I'm learning Spanish. Any tips?",
      "Practise a little every day rather than a lot once a week. Combine three things: a course or app for "
      "structure, listening to real Spanish such as podcasts or series with Spanish subtitles, and speaking as "
      "early as you can, even if only to yourself."),
     ("How many new words should I learn a day?",
      "Ten to twenty new words a day is a sustainable pace for most people, if you review them with spaced "
      "repetition. Learning them in short phrases rather than alone makes them easier to remember and use."),
     ("Should I learn grammar first?",
      "Learn grammar alongside vocabulary, not before it. The present tense, gender and basic word order let "
      "you build sentences early; the past tenses and the subjunctive can come later, once you are already "
      "using the language.")],
    [("Should I use print or logging in my Python program?",
      "Use `logging` for anything beyond a quick experiment. Log messages have levels, so you can hide debug "
      "output without deleting it; they carry timestamps and module names; and they can go to a file instead "
      "of the terminal, all configured in one place."),
     ("What is the simplest way to set it up?",
      "Configure it once at program start and get a logger in each module:\n\n"
      + python_block("""
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logger = logging.getLogger(__name__)
        logger.info("started")
        """)),
     ("How do I write the logs to a file?",
      "Pass `filename` to `basicConfig`: `logging.basicConfig(filename=\"app.log\", level=logging.INFO)`. To "
      "log to both a file and the terminal, pass a `FileHandler` and a `StreamHandler` in "
      "`basicConfig(handlers=[...])`.")],
]

PRODUCTS = [("notebook", "notebooks"), ("mug", "mugs"), ("T-shirt", "T-shirts"), ("plant pot", "plant pots"),
            ("book", "books"), ("phone case", "phone cases"), ("scarf", "scarves"), ("lamp bulb", "lamp bulbs")]


def shopping_thread(rng: random.Random, singular: str, plural: str) -> Pairs:
    """Price of n items, the same with a discount, and how many fit a budget; all in whole cents."""
    while True:
        price_cents, count = rng.randrange(150, 2500, 5), rng.randint(3, 12)
        percent = rng.choice([10, 15, 20, 25, 30])
        total_cents = price_cents * count
        if total_cents * percent % 100 == 0:  # a discount in whole cents, so every answer is exact
            break
    saving_cents = total_cents * percent // 100
    budget_dollars = rng.randint(2 * price_cents // 100 + 1, 200)
    affordable, left_cents = divmod(budget_dollars * 100, price_cents)
    noun = singular if affordable == 1 else plural
    return [
        (f"A {singular} costs {money(price_cents)}. How much do {count} of them cost?",
         f"{count} × {money(price_cents)} = {money(total_cents)}."),
        (f"What if there is a {percent}% discount on the whole order?",
         f"The discount is {percent}% of {money(total_cents)}, which is {money(saving_cents)}, so you would pay "
         f"{money(total_cents)} - {money(saving_cents)} = {money(total_cents - saving_cents)}."),
        (f"And how many could I buy with ${budget_dollars} at the full price?",
         f"${budget_dollars} / {money(price_cents)} = {affordable} with {money(left_cents)} left over, so you can "
         f"buy {affordable} {noun}."),
    ]


def weeks_needed(goal_dollars: int, weekly_dollars: int) -> tuple[int, str]:
    """Whole weeks to save `goal_dollars`, and the sentence that works it out."""
    weeks = -(-goal_dollars // weekly_dollars)
    exact = Fraction(goal_dollars, weekly_dollars)
    if exact.denominator == 1:
        return weeks, f"${goal_dollars} / ${weekly_dollars} = {weeks}, so it takes exactly {weeks} weeks."
    return weeks, (f"${goal_dollars} / ${weekly_dollars} is between {weeks - 1} and {weeks}, and you need whole "
                   f"weeks, so it takes {weeks} weeks. By then you will have ${weeks * weekly_dollars}.")


def savings_thread(rng: random.Random) -> Pairs:
    """Savings after w weeks, weeks to reach a goal, and how much sooner with a bigger weekly amount."""
    weekly, num_weeks, extra = rng.randint(15, 80), rng.randint(4, 20), rng.choice([5, 10, 15, 20])
    goal = rng.randrange(500, 3001, 50)
    weeks, working = weeks_needed(goal, weekly)
    faster_weeks, faster_working = weeks_needed(goal, weekly + extra)
    weeks_saved = weeks - faster_weeks
    sooner = ("It still takes the same number of whole weeks." if weeks_saved == 0
              else f"That is {weeks_saved} week{'s' if weeks_saved > 1 else ''} sooner.")
    return [
        (f"I save ${weekly} every week. How much will I have after {num_weeks} weeks?",
         f"{num_weeks} × ${weekly} = ${num_weeks * weekly}."),
        (f"How many weeks until I have ${goal}?", working),
        (f"What if I save ${extra} more each week?",
         f"Then you save ${weekly + extra} a week. {faster_working} {sooner}"),
    ]


def multi_turn_conversations(rng: random.Random) -> list[list[Message]]:
    conversations = []
    for index, thread in enumerate(THREADS):
        conversations.append(messages_of(thread))
        # The opening exchanges again, as a colleague with a system prompt would ask them.
        system = MULTI_TURN_SYSTEM_PROMPTS[index % len(MULTI_TURN_SYSTEM_PROMPTS)]
        conversations.append(messages_of(thread[:2], system))
    for singular, plural in PRODUCTS:
        conversations.append(messages_of(shopping_thread(rng, singular, plural)))
    for index in range(8):
        system = MATH_SYSTEM_PROMPTS[0] if index % 2 else None
        conversations.append(messages_of(savings_thread(rng), system))
    return conversations


# --- checks and output ---------------------------------------------------------------------------------

def check_conversation(messages: list[Message]) -> None:
    """Raises ValueError naming the conversation when it breaks a rule of the module docstring."""
    where = f"conversation starting {messages[0]['content'][:60]!r}"
    roles = [message["role"] for message in messages]
    body = roles[1:] if roles[0] == "system" else roles
    expected = ["user", "assistant"] * (len(body) // 2)
    if not body or body != expected:
        raise ValueError(f"{where}: roles {roles}; expected an optional system message, then user and "
                         "assistant messages alternating, ending with an assistant message")
    for message in messages:
        content = message["content"]
        if not content or content != content.strip():
            raise ValueError(f"{where}: a {message['role']} message is empty or has surrounding whitespace")
        if message["role"] == "assistant" and len(content) > MAX_ANSWER_CHARS:
            raise ValueError(f"{where}: an answer has {len(content)} characters; at most {MAX_ANSWER_CHARS}")


def build_rows() -> list[dict]:
    """Every conversation, in a fixed shuffled order so any prefix holds every kind, with its id."""
    rng = random.Random(SEED)
    kinds_and_messages = [
        *(("chat", messages) for messages in chat_conversations()),
        *(("code", messages) for messages in code_conversations()),
        *(("math", messages) for messages in math_conversations(rng)),
        *(("multi-turn", messages) for messages in multi_turn_conversations(rng)),
    ]
    seen = set()
    for _, messages in kinds_and_messages:
        check_conversation(messages)
        canonical = json.dumps(messages, sort_keys=True)
        if canonical in seen:
            raise ValueError(f"the conversation starting {messages[0]['content'][:60]!r} appears twice")
        seen.add(canonical)
    rng.shuffle(kinds_and_messages)
    return [{"id": f"demo-{number:04d}", "kind": kind, "messages": messages}
            for number, (kind, messages) in enumerate(kinds_and_messages, start=1)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUTPUT_PATH, help="where to write (default: %(default)s)")
    args = parser.parse_args(argv)
    rows = build_rows()
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(text.encode("utf-8"))
    counts = Counter(row["kind"] for row in rows)
    print(f"wrote {len(rows)} conversations ({', '.join(f'{kind} {n}' for kind, n in sorted(counts.items()))}), "
          f"{len(text.encode('utf-8'))} bytes, to {args.out}")


if __name__ == "__main__":
    main()
