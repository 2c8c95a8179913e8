//go:build linux

package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/shuntnet/shunt/guestlib"
)

// The checked-stream modes: every byte a reader gets is compared with the
// byte the writer's seeded stream has at that offset, whatever path (TCP
// or the rings) carried it, so a lost, duplicated or reordered byte is
// reported at its offset.
var streamModes = map[string]func(c *guestlib.Client, args []string) error{
	"duplex-server": func(c *guestlib.Client, args []string) error {
		if len(args) != 2 {
			return errors.New("usage: duplex-server PORT SECONDS")
		}
		conn, err := accept(c, args[0])
		if err != nil {
			return err
		}
		return duplex(conn, 2, 1, args[1])
	},
	"duplex-client": func(c *guestlib.Client, args []string) error {
		if len(args) != 2 {
			return errors.New("usage: duplex-client ADDR SECONDS")
		}
		conn, err := dial(c, args[0])
		if err != nil {
			return err
		}
		return duplex(conn, 1, 2, args[1])
	},
	"sink": func(c *guestlib.Client, args []string) error {
		if len(args) < 1 || len(args) > 2 || len(args) == 2 && args[1] != "after-down" {
			return errors.New("usage: sink PORT [after-down]")
		}
		conn, err := accept(c, args[0])
		if err != nil {
			return err
		}
		if len(args) == 2 {
			// Read nothing until hostd moved the connection to TCP:
			// what the peer wrote to the ring waits there.
			if err := waitFast(conn, 30*time.Second); err != nil {
				return err
			}
			if err := waitDown(conn, 2*time.Minute); err != nil {
				return err
			}
		}
		h := crc32.NewIEEE()
		n, err := check(conn, 3, h)
		if err == nil {
			err = io.EOF // check stops at EOF and reports it as nil
		}
		say("SINK %d %d %v", n, h.Sum32(), err)
		time.Sleep(100 * time.Millisecond) // let the console drain
		return conn.Close()
	},
	"writer": func(c *guestlib.Client, args []string) error {
		if len(args) != 1 {
			return errors.New("usage: writer ADDR")
		}
		conn, err := dial(c, args[0])
		if err != nil {
			return err
		}
		if err := waitFast(conn, 30*time.Second); err != nil {
			return err
		}
		// Stream until killed, saying how far every write got.
		return send(conn, 3, func(sent int64) bool {
			say("WROTE %d", sent)
			return true
		})
	},
}

// period is the length of a seeded stream's repeating pattern: a prime,
// so that no write or read size lines up with it.
const period = 65521

// maxChunk bounds one write of a checked stream.
const maxChunk = 128 << 10

// pattern returns seed's stream bytes from offset 0 up to period+maxChunk:
// the bytes at offset off are pattern[off%period:].
func pattern(seed uint64) []byte {
	p := make([]byte, period+maxChunk)
	for i := range p {
		p[i] = byte((uint64(i%period) + seed*0x5851F42D4C957F2D) * 0x9E3779B97F4A7C15 >> 56)
	}
	return p
}

// send writes seed's stream to conn in writes of random sizes (1 byte to
// maxChunk) until more, called after each write with the bytes sent so
// far, says stop. It returns the first write error.
func send(conn *guestlib.Conn, seed uint64, more func(sent int64) bool) error {
	p := pattern(seed)
	rng := rand.New(rand.NewPCG(seed, 1))
	var off int64
	for {
		n := 1 + rng.IntN(maxChunk)
		if rng.IntN(4) == 0 {
			n = 1 + rng.IntN(64) // small writes too
		}
		at := int(off % period)
		if _, err := conn.Write(p[at : at+n]); err != nil {
			return fmt.Errorf("write at offset %d: %w", off, err)
		}
		off += int64(n)
		if !more(off) {
			return nil
		}
	}
}

// check reads seed's stream from r to EOF, comparing every byte and adding
// it to h. It returns the bytes read and the read error (nil at EOF).
func check(r io.Reader, seed uint64, h io.Writer) (int64, error) {
	p := pattern(seed)
	buf := make([]byte, maxChunk)
	var off int64
	for {
		n, err := r.Read(buf)
		at := int(off % period)
		if !bytes.Equal(buf[:n], p[at:at+n]) {
			i := 0
			for buf[i] == p[at+i] {
				i++
			}
			return off, fmt.Errorf("byte at offset %d is %#x, want %#x", off+int64(i), buf[i], p[at+i])
		}
		h.Write(buf[:n])
		off += int64(n)
		if err == io.EOF {
			return off, nil
		}
		if err != nil {
			return off, err
		}
	}
}

// duplex sends seed mine for the given seconds and then half-closes, while
// it reads and checks seed theirs to EOF; it says
// "DUPLEX SENT n crc RECV m crc" when both are done.
func duplex(conn *guestlib.Conn, mine, theirs uint64, seconds string) error {
	return duplexAs(conn, mine, theirs, seconds, "DUPLEX")
}

// duplexAs is duplex reporting as "tag SENT n crc RECV m crc", for several
// duplex streams in one agent.
func duplexAs(conn *guestlib.Conn, mine, theirs uint64, seconds, tag string) error {
	secs, err := strconv.Atoi(seconds)
	if err != nil {
		return fmt.Errorf("seconds %q: %w", seconds, err)
	}
	type result struct {
		n   int64
		sum uint32
		err error
	}
	got := make(chan result, 1)
	var writeFailed atomic.Bool
	go func() {
		h := crc32.NewIEEE()
		n, err := check(conn, theirs, h)
		if err != nil && !writeFailed.Load() {
			// Say it now and end the connection: a writer blocked in a
			// send (its peer stopped reading too) would otherwise hide
			// this error for good, and both VMs would fall silent.
			say("%s READ-ERROR after %d bytes: %v", tag, n, err)
			conn.Close()
		}
		got <- result{n, h.Sum32(), err}
	}()
	h := crc32.NewIEEE()
	end := time.Now().Add(time.Duration(secs) * time.Second)
	var sent int64
	p := pattern(mine)
	err = send(conn, mine, func(off int64) bool {
		h.Write(p[sent%period : sent%period+(off-sent)])
		sent = off
		return time.Now().Before(end)
	})
	if err != nil {
		writeFailed.Store(true)
		conn.Close() // ends the reader too
		select {
		case r := <-got:
			if r.err != nil { // the cause, if the reader closed the connection
				return fmt.Errorf("read after %d bytes: %w (then the write failed: %v)", r.n, r.err, err)
			}
		case <-time.After(5 * time.Second):
		}
		return err
	}
	if err := conn.CloseWrite(); err != nil {
		return fmt.Errorf("half-close after %d bytes: %w", sent, err)
	}
	r := <-got
	if r.err != nil {
		return fmt.Errorf("read after %d bytes: %w", r.n, r.err)
	}
	say("%s SENT %d %d RECV %d %d", tag, sent, h.Sum32(), r.n, r.sum)
	return conn.Close()
}

// waitFast waits until conn is on the rings (READY came), at most bound.
func waitFast(conn *guestlib.Conn, bound time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	defer cancel()
	for !conn.Path().Fast {
		select {
		case <-ctx.Done():
			return fmt.Errorf("not on the rings within %s: %s", bound, conn.Path())
		case <-time.After(10 * time.Millisecond):
		}
	}
	say("FAST")
	return nil
}

// waitDown waits until conn left the rings (DOWN came), at most bound,
// and says "DOWN reason".
func waitDown(conn *guestlib.Conn, bound time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	defer cancel()
	for conn.Path().Fast {
		select {
		case <-ctx.Done():
			return fmt.Errorf("still on the rings after %s", bound)
		case <-time.After(10 * time.Millisecond):
		}
	}
	say("DOWN %s", conn.Path().Reason)
	return nil
}

// killWriter runs "writer ADDR" as a child process, which holds a control
// port of its own, copies its lines, and kills it with SIGKILL once it
// said it wrote at least bytes: a process that dies mid-stream inside the
// VM, which stays up. It says "KILLED pid n", n the last count the child
// reported, and then waits (the test decides when the VM goes).
func killWriter(addr, bytes string) error {
	want, err := strconv.ParseInt(bytes, 10, 64)
	if err != nil {
		return fmt.Errorf("bytes %q: %w", bytes, err)
	}
	cmd := exec.Command("/proc/self/exe", "writer", addr)
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return err
	}
	sc := bufio.NewScanner(out)
	var last int64
	for sc.Scan() {
		line := sc.Text()
		if n, ok := strings.CutPrefix(line, "SHUNT-VM WROTE "); ok {
			last, _ = strconv.ParseInt(n, 10, 64)
			if last >= want {
				break
			}
			continue // one line a write: too many for the console
		}
		fmt.Println(line)
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		return err
	}
	state, _ := cmd.Process.Wait()
	say("KILLED %d %d %s", cmd.Process.Pid, last, state)
	go io.Copy(io.Discard, out)
	for { // the VM stays up; the test stops it
		time.Sleep(time.Hour)
	}
}
