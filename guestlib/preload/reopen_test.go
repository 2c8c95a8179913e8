package preload

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib/guesttest"
	"github.com/shuntnet/shunt/internal/proto"
)

// xtestRun is shunt-xtest MODE CONTROL against a fake hostd: its stdout
// lines, its stderr (the core's log) as lines and whole, and its stdin.
type xtestRun struct {
	t         *testing.T
	ctx       context.Context
	h         *guesttest.Hostd
	out, errs chan string
	stdin     io.Writer
	mu        sync.Mutex
	log       bytes.Buffer
}

func runXtest(t *testing.T, mode string) *xtestRun {
	bin := xtest(t)
	r := &xtestRun{t: t, h: guesttest.Start(t), out: make(chan string, 16), errs: make(chan string, 256)}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	r.ctx = ctx
	cmd := exec.CommandContext(ctx, bin, mode, r.h.Control)
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
	r.stdin = stdin
	lines := func(rd io.Reader, ch chan string, keep bool) {
		defer close(ch)
		sc := bufio.NewScanner(rd)
		for sc.Scan() {
			if keep {
				r.mu.Lock()
				r.log.WriteString(sc.Text() + "\n")
				r.mu.Unlock()
			}
			select {
			case ch <- sc.Text():
			default: // nobody waits for this line
			}
		}
	}
	go lines(stdout, r.out, false)
	go lines(stderr, r.errs, true)
	return r
}

// fatalf fails the test with the core's log.
func (r *xtestRun) fatalf(format string, args ...any) {
	r.t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	r.t.Fatalf(format+"\nthe core's log:\n%s", append(args, r.log.String())...)
}

func (r *xtestRun) say(line string) {
	r.t.Helper()
	if _, err := io.WriteString(r.stdin, line+"\n"); err != nil {
		r.fatalf("write to shunt-xtest: %v", err)
	}
}

// next is the next line on ch (r.out or r.errs).
func (r *xtestRun) next(ch chan string, what string) string {
	r.t.Helper()
	select {
	case l, ok := <-ch:
		if !ok {
			r.fatalf("shunt-xtest ended before %s", what)
		}
		return l
	case <-r.ctx.Done():
		r.fatalf("no %s within 60 s", what)
	}
	return ""
}

// expect fails unless the program's next line starts with want.
func (r *xtestRun) expect(want string) string {
	r.t.Helper()
	l := r.next(r.out, strconv.Quote(want))
	if !strings.HasPrefix(l, want) {
		r.fatalf("shunt-xtest said %q, want %q...", l, want)
	}
	return l
}

// logged waits for a core's log line that holds want.
func (r *xtestRun) logged(want string) {
	r.t.Helper()
	for !strings.Contains(r.next(r.errs, "the log line "+strconv.Quote(want)), want) {
	}
}

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
	r := runXtest(t, "reopen")
	s1 := r.h.Accept(t)
	s1.Expect(t, proto.Hello)
	s1.WelcomeNoRegion(t)
	r.expect("open")
	s1.Close() // hostd goes away: the reader reopens

	s2 := r.h.Accept(t)
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

	r.say("go")
	select {
	case l, ok := <-r.out:
		if !ok || !strings.HasPrefix(l, "ensure -1") || !strings.HasSuffix(l, "send -1") {
			r.fatalf("during the open, shunt-xtest said %q (open %v), want ensure -1 ... send -1 (no channel yet)", l, ok)
		}
		t.Logf("during the open: %s", l)
	case rd := <-got:
		r.fatalf("the opener gave up on the silent channel (%v, %v) before the program thread's ensure and send returned: they waited for the open", rd.m.Type, rd.err)
	case <-r.ctx.Done():
		r.fatalf("the program thread's ensure and send did not return within 60 s")
	}
	select {
	case rd := <-got:
		r.fatalf("the silent channel ended (%v, %v) before WELCOME was sent", rd.m.Type, rd.err)
	default:
	}

	s2.WelcomeNoRegion(t)
	r.expect("announced")
	r.say("go")
	r.expect("ensure 0 (ok) send 0")
	select {
	case rd := <-got:
		if rd.err != nil || rd.m.Type != proto.Close {
			r.fatalf("on the reopened channel: %v, %v, want CLOSE", rd.m.Type, rd.err)
		}
	case <-r.ctx.Done():
		r.fatalf("no CLOSE on the reopened channel within 60 s")
	}
}

// during runs shunt-xtest MODE: once the program says first and the core
// logs logged (the step under test waits in the open), the fake answers
// WELCOME; the program's next two lines, in any order, must be want's.
func during(t *testing.T, mode, first, logged string, want [2]string, why string) {
	r := runXtest(t, mode)
	s := r.h.Accept(t)
	s.Expect(t, proto.Hello) // thread a opens and waits for WELCOME
	r.say("go")
	r.expect(first)
	r.logged(logged)
	s.WelcomeNoRegion(t)
	got := map[string]bool{}
	for range 2 {
		got[r.next(r.out, "the answers after WELCOME")] = true
	}
	if !got[want[0]] || !got[want[1]] {
		r.fatalf("shunt-xtest said %v, want %q and %q: %s", got, want[0], want[1], why)
	}
}

// TestCEnsureWaitsForOpen: two threads that need the channel at once (a
// program's threads connecting at its start, TestServerMemcached's 8)
// both reach hostd: the second's ensure, made during the first's open of
// the process's channel, waits for it instead of leaving its connection
// on TCP. By order, not time: WELCOME goes only once the core logged
// that the second waits (the bound is 60 s here, c.open_wait_ms).
func TestCEnsureWaitsForOpen(t *testing.T) {
	during(t, "together", "b calls ensure", "waiting for another thread's open",
		[2]string{"a ensure 0 (ok)", "b ensure 0 (ok)"}, "the second's connection would have stayed on TCP")
}

// TestCForkWaitsForOpen: a fork while another thread opens the channel
// waits for that open, so the child does not inherit the half-open
// channel (hostd would not see the parent's session end while the child
// lives; a port would stay busy). WELCOME goes once the core logged that
// the fork waits; the child then has no socket (fork_child closes the
// installed channel).
func TestCForkWaitsForOpen(t *testing.T) {
	during(t, "forkopen", "forking", "fork waits for the control channel's open",
		[2]string{"child sockets 0", "a ensure 0 (ok)"}, "the child inherited the half-open channel")
}
