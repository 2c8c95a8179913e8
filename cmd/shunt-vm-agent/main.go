//go:build linux

// Command shunt-vm-agent is the program the VM tests run inside QEMU guests
// (integration/vm): guestlib with its defaults, which find the VM's
// control port and ivshmem region on their own, reporting on the console
// with "SHUNT-VM" lines.
//
//	shunt-vm-agent server PORT        accept one connection; read it to EOF
//	shunt-vm-agent client ADDR BYTES  send BYTES (seeded), half-close, await "done"
//	shunt-vm-agent hold ADDR          connect and block in Read; report how it ended
//	shunt-vm-agent serve-hold PORT    accept one connection and block in Read likewise
//	shunt-vm-agent pp-server PORT     echo 8-byte messages, then sink a stream
//	shunt-vm-agent pp-client ADDR N [fast]  N ping-pongs, then a 64 MiB stream; report
//	                                  both (fast: once the connection is on the rings)
//	shunt-vm-agent run LIB PROG ARGS  run an unmodified program with LD_PRELOAD=LIB
//	                                  (LIB "none": without; the C library finds the
//	                                  port and the BAR itself); its output comes as
//	                                  "OUT" lines, then "EXIT code". "A + B" runs A and
//	                                  B at once, "A then B" one after the other; with
//	                                  several programs the lines are "OUT<i>", "EXIT<i>"
//	shunt-vm-agent exec-server PORT   run the shell command each connection sends
//	                                  (one line), output back on the connection: the
//	                                  VM end of an rsh for mpirun, over kernel TCP
//	shunt-vm-agent rsh PORT HOST CMD  the host end: run CMD in the VM at HOST
//	shunt-vm-agent duplex-server PORT SECS  accept one connection; a checked stream
//	                                  each way for SECS, half-close, read to EOF
//	shunt-vm-agent duplex-client ADDR SECS  the same, connecting
//	shunt-vm-agent sink PORT [after-down]  accept one connection; read a checked
//	                                  stream until EOF or an error; report how it
//	                                  ended (after-down: read only once hostd moved
//	                                  the connection to TCP)
//	shunt-vm-agent kill-writer ADDR BYTES  run "writer ADDR" (a checked stream on
//	                                  the rings, forever) as a child process and
//	                                  SIGKILL it once it wrote BYTES (stream.go)
//	shunt-vm-agent port-clients ADDR N BYTES  N clients in one process, a
//	                                  control port each while there are ports
//	shunt-vm-agent accept-many PORT N  accept N connections (ports.go)
//
// A first argument "tcp" keeps every connection on the VM's kernel TCP
// (virtio-net), for comparison.
package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/shuntnet/shunt/guestlib"
	"github.com/shuntnet/shunt/internal/execserve"
)

func say(format string, args ...any) { fmt.Printf("SHUNT-VM "+format+"\n", args...) }

// accept listens on port, says LISTENING, and accepts one connection.
func accept(c *guestlib.Client, port string) (*guestlib.Conn, error) {
	l, err := (&guestlib.ListenConfig{Client: c}).Listen(context.Background(), "tcp4", ":"+port)
	if err != nil {
		return nil, err
	}
	say("LISTENING")
	conn, err := l.AcceptShunt()
	if err == nil {
		sayPath(conn)
	}
	return conn, err
}

// dial connects to addr and says which path it took.
func dial(c *guestlib.Client, addr string) (*guestlib.Conn, error) {
	conn, err := (&guestlib.Dialer{Client: c}).DialContext(context.Background(), "tcp4", addr)
	if err == nil {
		sayPath(conn)
	}
	return conn, err
}

// pathWait bounds the wait for hostd's answer about a connection:
// connections start on TCP and move to the rings when hostd says READY,
// so the PATH line reports the path after that answer.
const pathWait = 5 * time.Second

// sayPath reports the connection's path once hostd has answered. A TCP
// answer that READY may still follow (the peer's session or LISTEN was
// on its way: no-intent, no-listener) is waited out, within pathWait.
func sayPath(conn *guestlib.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), pathWait)
	defer cancel()
	p := conn.WaitPath(ctx)
	for !p.Fast && provisional[p.Reason] && ctx.Err() == nil {
		select {
		case <-ctx.Done():
		case <-time.After(10 * time.Millisecond):
		}
		p = conn.Path()
	}
	say("PATH %s", p)
}

// provisional are the TCP reasons hostd gives while it still waits for
// the connection's other end.
var provisional = map[string]bool{"pending": true, "no-intent": true, "no-listener": true}

func main() {
	err := run(os.Args[1:])
	if err != nil {
		say("ERROR %v", err)
	}
	if len(os.Args) > 1 && os.Args[1] == "bars" {
		// The VM stays up, reporting its devices (pair.go): hostd
		// unplugs a region after its last flow, and the test watches.
		say("DONE")
		select {}
	}
	if err != nil {
		os.Exit(1)
	}
}

func run(args []string) error {
	if len(args) >= 3 && args[0] == "run" {
		return runPreloaded(args[1], args[2:])
	}
	if len(args) == 2 && args[0] == "exec-server" {
		return execServer(args[1])
	}
	if len(args) >= 4 && args[0] == "rsh" {
		return rsh(args[1], args[2], args[3:])
	}
	if len(args) == 3 && args[0] == "kill-writer" {
		return killWriter(args[1], args[2]) // the child takes the port
	}
	bars := len(args) > 0 && args[0] == "bars"
	if bars {
		args = args[1:]
	}
	disable := len(args) > 0 && args[0] == "tcp"
	if disable {
		args = args[1:]
	}
	// guestlib's defaults: the first free control port, the ivshmem BAR
	// as the region, wake-ups by KICK (docs/vm.md, "Discovery").
	c, err := guestlib.NewClient(guestlib.Options{Disable: disable,
		Logf: func(f string, a ...any) { say("LOG "+f, a...) }})
	if err != nil {
		return err
	}
	if bars {
		go reportBars(c) // pair.go
	}
	switch {
	case len(args) == 2 && args[0] == "server":
		conn, err := accept(c, args[1])
		if err != nil {
			return err
		}
		h := crc32.NewIEEE()
		n, err := io.Copy(h, conn)
		if err != nil {
			return err
		}
		say("RECV %d %d", n, h.Sum32())
		conn.Write([]byte("done\n"))
		io.Copy(io.Discard, conn)
		return conn.Close()
	case len(args) == 3 && args[0] == "client":
		total, _ := strconv.Atoi(args[2])
		conn, err := dial(c, args[1])
		if err != nil {
			return err
		}
		src := rand.NewChaCha8([32]byte{7})
		buf := make([]byte, 256<<10)
		var sum uint32
		for left := total; left > 0; left -= len(buf[:min(left, len(buf))]) {
			b := buf[:min(left, len(buf))]
			src.Read(b)
			sum = crc32.Update(sum, crc32.IEEETable, b)
			if _, err := conn.Write(b); err != nil {
				return err
			}
		}
		conn.CloseWrite()
		reply := make([]byte, 5)
		if _, err := io.ReadFull(conn, reply); err != nil {
			return err
		}
		say("SENT %d %d", total, sum)
		return conn.Close()
	case len(args) == 2 && (args[0] == "hold" || args[0] == "serve-hold"):
		var conn *guestlib.Conn
		if args[0] == "hold" {
			conn, err = dial(c, args[1])
		} else {
			conn, err = accept(c, args[1])
		}
		if err != nil {
			return err
		}
		_, err = conn.Read(make([]byte, 1))
		say("READERR %v", err)
		time.Sleep(100 * time.Millisecond) // let the console drain before power-off
		return nil
	case len(args) == 2 && args[0] == "pp-server":
		conn, err := accept(c, args[1])
		if err != nil {
			return err
		}
		buf := make([]byte, 8)
		for {
			if _, err := io.ReadFull(conn, buf); err != nil {
				return err
			}
			if string(buf) == "streamnw" { // the client switches to streaming
				break
			}
			if _, err := conn.Write(buf); err != nil {
				return err
			}
		}
		n, err := io.Copy(io.Discard, conn)
		fmt.Fprintf(conn, "%d\n", n)
		say("SINK %d", n)
		return err
	case (len(args) == 3 || len(args) == 4 && args[3] == "fast") && args[0] == "pp-client":
		iters, _ := strconv.Atoi(args[2])
		conn, err := dial(c, args[1])
		if err != nil {
			return err
		}
		if len(args) == 4 { // measure the rings only (across hosts, READY can take a while)
			if err := waitFast(conn, 30*time.Second); err != nil {
				return err
			}
		}
		msg, back := []byte("pingpong"), make([]byte, 8)
		start := time.Now()
		for range iters {
			conn.Write(msg)
			if _, err := io.ReadFull(conn, back); err != nil {
				return err
			}
		}
		say("PINGPONG %d", time.Since(start).Nanoseconds()/int64(2*iters))
		conn.Write([]byte("streamnw"))
		buf := make([]byte, 64<<10)
		const total = 64 << 20
		start = time.Now()
		for sent := 0; sent < total; sent += len(buf) {
			if _, err := conn.Write(buf); err != nil {
				return err
			}
		}
		conn.CloseWrite()
		var n int
		if _, err := fmt.Fscanln(conn, &n); err != nil || n != total {
			return fmt.Errorf("sink reported %d bytes (%v), want %d", n, err, total)
		}
		say("STREAM %.1f", float64(total)/time.Since(start).Seconds()/1e6)
		return conn.Close()
	}
	if len(args) > 0 && streamModes[args[0]] != nil {
		return streamModes[args[0]](c, args[1:])
	}
	return fmt.Errorf("usage: [tcp] server PORT | client ADDR BYTES | hold ADDR | serve-hold PORT | pp-server PORT | pp-client ADDR N [fast]")
}

// runPreloaded runs programs under the preload library and reports their
// output and exit status: stages separated by "then" one after the other,
// programs in a stage separated by "+" at once. The agent does not open a
// control port itself: a port has one user at a time.
func runPreloaded(lib string, args []string) error {
	var stages [][][]string
	for _, stage := range split(args, "then") {
		stages = append(stages, split(stage, "+"))
	}
	total := 0
	for _, st := range stages {
		total += len(st)
	}
	var errs []error
	n := 0
	for _, st := range stages {
		var wg sync.WaitGroup
		stageErrs := make([]error, len(st))
		for j, prog := range st {
			tag := ""
			if total > 1 {
				tag = strconv.Itoa(n)
			}
			n++
			if len(prog) == 0 {
				return fmt.Errorf("run: an empty program")
			}
			cmd := exec.Command(prog[0], prog[1:]...)
			cmd.Env = os.Environ()
			if lib != "none" {
				cmd.Env = append(cmd.Env, "LD_PRELOAD="+lib, "SHUNT_VERBOSE=1")
			}
			out, err := cmd.StdoutPipe()
			if err != nil {
				return err
			}
			cmd.Stderr = cmd.Stdout
			if err := cmd.Start(); err != nil {
				return err
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				sc := bufio.NewScanner(out)
				for sc.Scan() {
					say("OUT%s %s", tag, sc.Text())
				}
				stageErrs[j] = cmd.Wait()
				say("EXIT%s %d", tag, cmd.ProcessState.ExitCode())
			}()
		}
		wg.Wait()
		errs = append(errs, stageErrs...)
	}
	return errors.Join(errs...)
}

// split cuts args at each sep.
func split(args []string, sep string) [][]string {
	var out [][]string
	for {
		i := slices.Index(args, sep)
		if i < 0 {
			return append(out, args)
		}
		out = append(out, args[:i])
		args = args[i+1:]
	}
}

// execServer serves mpirun's rsh agent (internal/execserve): the test
// has no ssh in its VMs.
func execServer(port string) error {
	l, err := net.Listen("tcp", ":"+port)
	if err != nil {
		return err
	}
	say("LISTENING")
	return execserve.Serve(l, nil, "", say)
}

// rsh runs cmd in the VM at host through its exec server, copying the
// output to stdout.
func rsh(port, host string, cmd []string) error {
	c, err := net.Dial("tcp", net.JoinHostPort(host, port))
	if err != nil {
		return err
	}
	defer c.Close()
	if _, err := fmt.Fprintln(c, strings.Join(cmd, " ")); err != nil {
		return err
	}
	_, err = io.Copy(os.Stdout, c)
	return err
}
