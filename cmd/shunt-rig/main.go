//go:build linux

// Command shunt-rig creates and removes the network-namespace test host that
// Shunt's tests, demo and benchmarks use (see integration/nsrig).
//
//	shunt-rig create [-name demo] [-guests 2] [-hosts 2]
//	shunt-rig destroy [-name demo] [-guests 2] [-hosts 2]
//	shunt-rig exec [-name demo] [-hosts 2] GUEST -- command args...
//
// GUEST is g1, g2, ... or host; with -hosts 2 (two hosts joined by a
// fabric veth, nsrig.Fabric), h1 or h2 for a host and h1/g1 ... for a
// guest of one. hostd is not started: run one per host namespace.
package main

import (
	"flag"
	"fmt"
	"os"
	"os/exec"

	"github.com/shuntnet/shunt/integration/nsrig"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: shunt-rig create|destroy|exec [-name NAME] [-guests N] [GUEST -- cmd...]")
		os.Exit(2)
	}
	fs := flag.NewFlagSet(os.Args[1], flag.ExitOnError)
	name := fs.String("name", "demo", "rig name (1-8 characters)")
	n := fs.Int("guests", 2, "number of guests (per host)")
	hosts := fs.Int("hosts", 1, "number of hosts: 1, or 2 joined by a fabric veth")
	fs.Parse(os.Args[2:])
	if *hosts != 1 {
		fabric(os.Args[1], *name, *hosts, *n, fs.Args())
		return
	}
	r, err := nsrig.New(*name, *n)
	if err != nil {
		fail(err)
	}
	switch os.Args[1] {
	case "create":
		if err := r.Create(); err != nil {
			fail(err)
		}
		fmt.Printf("rig %s: host netns %s\n", r.Name, r.HostNS)
		for _, g := range r.Guests {
			fmt.Printf("  %s: netns %s, address %s, host interface %s\n", g.Name, g.NS, g.Addr, g.HostIf)
		}
	case "destroy":
		if err := r.Destroy(); err != nil {
			fail(err)
		}
	case "exec":
		args := fs.Args()
		if len(args) < 3 || args[1] != "--" {
			fail(fmt.Errorf("usage: shunt-rig exec GUEST -- COMMAND [ARGS]"))
		}
		ns := r.HostNSPath()
		for _, g := range r.Guests {
			if g.Name == args[0] {
				ns = g.NSPath()
			}
		}
		run(ns, args[2:])
	default:
		fail(fmt.Errorf("unknown command %q", os.Args[1]))
	}
}

// fabric runs a command on a rig of several hosts.
func fabric(verb, name string, hosts, guests int, args []string) {
	f, err := nsrig.NewFabric(name, hosts, guests)
	if err != nil {
		fail(err)
	}
	switch verb {
	case "create":
		if err := f.Create(); err != nil {
			fail(err)
		}
		for k, r := range f.Hosts {
			fmt.Printf("h%d: host netns %s, fabric %s %s %s, guests %s\n", k+1, r.HostNS, f.If, f.Addrs[k], f.Addrs6[k], f.Prefixes(k))
			for _, g := range r.Guests {
				fmt.Printf("  h%d/%s: netns %s, address %s %s, host interface %s\n", k+1, g.Name, g.NS, g.Addr, g.Addr6, g.HostIf)
			}
		}
	case "destroy":
		if err := f.Destroy(); err != nil {
			fail(err)
		}
	case "exec":
		if len(args) < 3 || args[1] != "--" {
			fail(fmt.Errorf("usage: shunt-rig exec -hosts 2 h1|h2|h1/g1... -- COMMAND [ARGS]"))
		}
		ns, err := f.Find(args[0])
		if err != nil {
			fail(err)
		}
		run(ns, args[2:])
	default:
		fail(fmt.Errorf("unknown command %q", verb))
	}
}

// run runs argv in the namespace at ns, with this process's stdio.
func run(ns string, argv []string) {
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	if err := nsrig.Start(ns, cmd); err != nil {
		fail(err)
	}
	if err := cmd.Wait(); err != nil {
		fail(err)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "shunt-rig:", err)
	os.Exit(1)
}
