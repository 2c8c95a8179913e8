package preload

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"os/exec"
	"strconv"
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

// openRun is shunt-xtest MODE CONTROL whose thread a opens the session
// against a fake hostd that holds WELCOME back: its stdout and stderr (the
// core's log) as lines, "go" written once HELLO came, and the fake's
// session to answer on.
type openRun struct {
	t         *testing.T
	ctx       context.Context
	out, errs chan string
	log       *bytes.Buffer
	s         *guesttest.Session
}

func startOpenRun(t *testing.T, mode string) *openRun {
	bin := xtest(t)
	h := guesttest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	cmd := exec.CommandContext(ctx, bin, mode, h.Control)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	r := &openRun{t: t, ctx: ctx, out: make(chan string, 16), errs: make(chan string, 64), log: &bytes.Buffer{}}
	lines := func(rd io.Reader, ch chan string) {
		defer close(ch)
		sc := bufio.NewScanner(rd)
		for sc.Scan() {
			ch <- sc.Text()
		}
	}
	go lines(stdout, r.out)
	go lines(stderr, r.errs)
	r.s = h.Accept(t)
	r.s.Expect(t, proto.Hello) // thread a opens and waits for WELCOME
	if _, err := stdin.Write([]byte("go\n")); err != nil {
		t.Fatal(err)
	}
	return r
}

// next is the program's next line on ch, the core's log lines kept.
func (r *openRun) next(ch chan string, what string) string {
	r.t.Helper()
	for {
		select {
		case l, ok := <-ch:
			if !ok {
				r.t.Fatalf("shunt-xtest ended before %s\nthe core's log:\n%s", what, r.log.String())
			}
			if ch == r.errs {
				r.log.WriteString(l + "\n")
			}
			return l
		case <-r.ctx.Done():
			r.t.Fatalf("no %s within 60 s\nthe core's log:\n%s", what, r.log.String())
		}
	}
}

// logged waits for a core's log line that holds want.
func (r *openRun) logged(want string) {
	r.t.Helper()
	for !strings.Contains(r.next(r.errs, "the log line "+strconv.Quote(want)), want) {
	}
}

// TestCEnsureWaitsForOpen: two threads that need the channel at once (a
// program's threads connecting at its start, TestServerMemcached's 8)
// both reach hostd: the second's ensure, made during the first's open of
// the process's channel, waits for it instead of leaving its connection
// on TCP. By order, not time: WELCOME goes only once the core logged
// that the second waits (the bound is 60 s here, c.open_wait_ms).
func TestCEnsureWaitsForOpen(t *testing.T) {
	r := startOpenRun(t, "together")
	if l := r.next(r.out, "b's line"); l != "b calls ensure" {
		t.Fatalf("shunt-xtest said %q, want \"b calls ensure\"", l)
	}
	r.logged("waiting for another thread's open")
	r.s.WelcomeNoRegion(t)
	got := map[string]bool{}
	for range 2 {
		got[r.next(r.out, "both ensures' answers")] = true
	}
	if !got["a ensure 0 (ok)"] || !got["b ensure 0 (ok)"] {
		t.Fatalf("the two threads said %v, want both ensure 0: the second's connection would have stayed on TCP\nthe core's log:\n%s", got, r.log.String())
	}
}

// TestCForkWaitsForOpen: a fork while another thread opens the channel
// waits for that open, so the child does not inherit the half-open
// channel (hostd would not see the parent's session end while the child
// lives; a port would stay busy). WELCOME goes once the core logged that
// the fork waits; the child then has no socket (fork_child closes the
// installed channel).
func TestCForkWaitsForOpen(t *testing.T) {
	r := startOpenRun(t, "forkopen")
	if l := r.next(r.out, "the fork's line"); l != "forking" {
		t.Fatalf("shunt-xtest said %q, want \"forking\"", l)
	}
	r.logged("fork waits for the control channel's open")
	r.s.WelcomeNoRegion(t)
	got := map[string]bool{}
	for range 2 {
		got[r.next(r.out, "the child's and a's lines")] = true
	}
	if !got["child sockets 0"] || !got["a ensure 0 (ok)"] {
		t.Fatalf("shunt-xtest said %v, want \"child sockets 0\" and a's ensure 0\nthe core's log:\n%s", got, r.log.String())
	}
}
