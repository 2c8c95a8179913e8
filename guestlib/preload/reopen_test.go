package preload

import (
	"bufio"
	"bytes"
	"context"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib/guesttest"
	"github.com/shuntnet/shunt/internal/proto"
)

// TestCReopenWithoutLock: while the C core's reader thread reopens the
// control channel to a hostd that accepts and never answers WELCOME, a
// program thread's ensure and send (a connect() and a close()) return at
// once, finding no channel (the connection stays on TCP), instead of
// waiting on the session's lock for the open: up to 5 s for WELCOME, over
// vsock 12 s. Asserted by order, not time: their answer comes while the
// opener still waits on the silent channel (the fake has not seen it
// end), and that same channel then becomes the session's once WELCOME
// comes (the next send arrives on it).
func TestCReopenWithoutLock(t *testing.T) {
	bin := xtest(t)
	h := guesttest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "reopen", h.Control)
	var log bytes.Buffer // the core's log; read after Wait
	cmd.Stderr = &log
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := make(chan string, 16)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines <- sc.Text()
		}
	}()
	fail := func(format string, args ...any) {
		t.Helper()
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		t.Fatalf(format+"\nthe core's log:\n%s", append(args, log.String())...)
	}
	line := func(want string) string {
		t.Helper()
		select {
		case l, ok := <-lines:
			if !ok || !strings.HasPrefix(l, want) {
				fail("shunt-xtest said %q (open %v), want %q...", l, ok, want)
			}
			return l
		case <-ctx.Done():
			fail("shunt-xtest did not say %q within 60 s", want)
		}
		return ""
	}

	s1 := h.Accept(t)
	s1.Expect(t, proto.Hello)
	s1.WelcomeNoRegion(t)
	line("open")
	s1.Close() // hostd goes away: the reader reopens

	s2 := h.Accept(t)
	s2.Expect(t, proto.Hello) // the opener now waits for WELCOME
	type read struct {
		m   proto.Msg
		err error
	}
	got := make(chan read, 4)
	go func() {
		for {
			m, err := s2.Read(time.Minute)
			got <- read{m, err}
			if err != nil {
				return
			}
		}
	}()

	if _, err := stdin.Write([]byte("go\n")); err != nil {
		fail("write to shunt-xtest: %v", err)
	}
	select {
	case l, ok := <-lines:
		if !ok || !strings.HasPrefix(l, "ensure -1") || !strings.HasSuffix(l, "send -1") {
			fail("during the open, shunt-xtest said %q (open %v), want ensure -1 ... send -1 (no channel yet)", l, ok)
		}
		t.Logf("during the open: %s", l)
	case r := <-got:
		fail("the opener gave up on the silent channel (%v, %v) before the program thread's ensure and send returned: they waited for the open", r.m.Type, r.err)
	case <-ctx.Done():
		fail("the program thread's ensure and send did not return within 60 s")
	}
	select {
	case r := <-got:
		fail("the silent channel ended (%v, %v) before WELCOME was sent", r.m.Type, r.err)
	default:
	}

	s2.WelcomeNoRegion(t)
	line("announced")
	if _, err := stdin.Write([]byte("go\n")); err != nil {
		fail("write to shunt-xtest: %v", err)
	}
	line("ensure 0 (ok) send 0")
	select {
	case r := <-got:
		if r.err != nil || r.m.Type != proto.Close {
			fail("on the reopened channel: %v, %v, want CLOSE", r.m.Type, r.err)
		}
	case <-ctx.Done():
		fail("no CLOSE on the reopened channel within 60 s")
	}
	stdin.Close()
	if err := cmd.Wait(); err != nil {
		t.Fatalf("shunt-xtest reopen: %v\n%s", err, log.String())
	}
}

// TestCEnsureWaitsForOpen: two threads that need the channel at once (a
// program's threads connecting at its start, TestServerMemcached's 8)
// both reach hostd: the second's ensure, made while the first's open
// waits for WELCOME, waits for that open (up to SHUNT_OPEN_WAIT_NS after
// it began) instead of leaving its connection on TCP. The fake holds
// WELCOME back 100 ms after the second says it calls ensure, so that
// call is made during the open.
func TestCEnsureWaitsForOpen(t *testing.T) {
	bin := xtest(t)
	h := guesttest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "together", h.Control)
	var log bytes.Buffer
	cmd.Stderr = &log
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	lines := make(chan string, 16)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines <- sc.Text()
		}
	}()
	next := func() string {
		t.Helper()
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("shunt-xtest together ended early\nthe core's log:\n%s", log.String())
			}
			return l
		case <-ctx.Done():
			t.Fatalf("shunt-xtest together said nothing within 60 s\nthe core's log:\n%s", log.String())
		}
		return ""
	}

	s := h.Accept(t)
	s.Expect(t, proto.Hello) // thread a opens and waits for WELCOME
	if _, err := stdin.Write([]byte("go\n")); err != nil {
		t.Fatal(err)
	}
	if l := next(); l != "b waits" {
		t.Fatalf("shunt-xtest said %q, want \"b waits\"", l)
	}
	time.Sleep(100 * time.Millisecond) // b's ensure is now under way (or it did not wait: the bug)
	s.WelcomeNoRegion(t)
	got := map[string]bool{}
	for range 2 {
		got[next()] = true
	}
	if !got["a ensure 0 (ok)"] || !got["b ensure 0 (ok)"] {
		t.Fatalf("the two threads said %v, want both ensure 0: the second's connection would have stayed on TCP\nthe core's log:\n%s", got, log.String())
	}
}
