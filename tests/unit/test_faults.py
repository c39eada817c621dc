"""The retry policy and the circuit breaker every backend kind shares, as pure logic with an injected
clock. The same faults from a real server (through a fault-injecting proxy in front of vLLM) are in
tests/e2e/test_faults.py; through the scripted kind, in tests/unit/test_scripted_pass.py.
"""

from canaryd.backends.resilience import CircuitBreaker, RetryPolicy


def test_retry_policy_backs_off_with_jitter_and_honours_retry_after():
    p = RetryPolicy(retries=3, backoff_s=0.5, max_wait_s=3)
    assert p.wait_s(1, rand=lambda: 0.0) == 0.5 and p.wait_s(1, rand=lambda: 1.0) == 1.0
    assert p.wait_s(2, rand=lambda: 0.0) == 1.0 and p.wait_s(4, rand=lambda: 1.0) == 3  # capped
    assert p.wait_s(1, retry_after=2.0) == 2.0 and p.wait_s(1, retry_after=99) == 3


def test_circuit_breaker_opens_cools_down_and_lets_one_trial_through():
    now = [0.0]
    b = CircuitBreaker(failures=2, cooldown_s=10, clock=lambda: now[0])
    b.record(False)
    assert b.allow() and b.state == "closed"
    b.record(False)
    assert b.state == "open" and not b.allow()
    now[0] = 10.0
    assert b.state == "half-open" and b.allow() and not b.allow()  # exactly one trial
    b.record(False)
    assert b.state == "open" and not b.allow()
    now[0] = 20.0
    assert b.allow()
    b.record(True)
    assert b.state == "closed" and b.allow() and b.allow()
