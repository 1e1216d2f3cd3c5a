//! IPv4 networks (`a.b.c.d/len`): a cluster's pod and Service ranges.

use std::net::Ipv4Addr;

/// An IPv4 network `a.b.c.d/len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv4Net {
    pub addr: Ipv4Addr,
    pub len: u8,
}

impl Ipv4Net {
    /// Parse `a.b.c.d/len` (a bare address is a /32).
    pub fn parse(s: &str) -> Option<Ipv4Net> {
        let (a, l) = s.split_once('/').unwrap_or((s, "32"));
        let len: u8 = l.parse().ok().filter(|l| *l <= 32)?;
        Some(Ipv4Net {
            addr: a.parse().ok()?,
            len,
        })
    }

    fn mask(self) -> u32 {
        if self.len == 0 {
            0
        } else {
            u32::MAX << (32 - u32::from(self.len))
        }
    }

    /// Whether `other` lies entirely inside this network.
    pub fn contains(self, other: Ipv4Net) -> bool {
        other.len >= self.len
            && (u32::from(other.addr) & self.mask()) == (u32::from(self.addr) & self.mask())
    }

    /// The first host address (`10.244.N.1` for `10.244.N.0/24`): the pod gateway.
    pub fn first_host(self) -> Ipv4Addr {
        Ipv4Addr::from((u32::from(self.addr) & self.mask()).wrapping_add(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_nets() {
        let n = Ipv4Net::parse("10.244.7.0/24").expect("cidr");
        assert_eq!(n.first_host(), Ipv4Addr::new(10, 244, 7, 1));
        assert!(n.contains(Ipv4Net::parse("10.244.7.9").expect("ip")));
        assert!(!n.contains(Ipv4Net::parse("10.244.8.9").expect("ip")));
        assert!(!n.contains(Ipv4Net::parse("10.244.0.0/16").expect("cidr")));
        assert!(Ipv4Net::parse("0.0.0.0/0").expect("all").contains(n));
        assert_eq!(Ipv4Net::parse("10.0.0.0/33"), None);
        assert_eq!(Ipv4Net::parse("nope"), None);
    }
}
