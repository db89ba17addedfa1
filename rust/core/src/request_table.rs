//! Live requests in a dense slab: the step loop addresses them by slot (an index), the API by
//! id through one hash lookup.

use rustc_hash::FxHashMap;

use crate::request::{Request, RequestId};

/// Index of a live request in the table; reused after the request is removed.
pub type Slot = u32;

#[derive(Debug, Default)]
pub struct RequestTable {
    slots: Vec<Option<Request>>,
    free: Vec<Slot>,
    by_id: FxHashMap<RequestId, Slot>,
}

impl RequestTable {
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    pub fn contains(&self, id: RequestId) -> bool {
        self.by_id.contains_key(&id)
    }

    pub fn slot_of(&self, id: RequestId) -> Option<Slot> {
        self.by_id.get(&id).copied()
    }

    pub fn insert(&mut self, req: Request) -> Slot {
        let id = req.id;
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot as usize] = Some(req);
                slot
            }
            None => {
                self.slots.push(Some(req));
                (self.slots.len() - 1) as Slot
            }
        };
        self.by_id.insert(id, slot);
        slot
    }

    pub fn remove(&mut self, slot: Slot) -> Request {
        let req = self.slots[slot as usize].take().expect("slot is live");
        self.by_id.remove(&req.id);
        self.free.push(slot);
        req
    }

    /// The request in `slot`, if that slot is live.
    pub fn get(&self, slot: Slot) -> Option<&Request> {
        self.slots.get(slot as usize).and_then(Option::as_ref)
    }

    pub fn get_mut(&mut self, slot: Slot) -> Option<&mut Request> {
        self.slots.get_mut(slot as usize).and_then(Option::as_mut)
    }

    pub fn by_id(&self, id: RequestId) -> Option<&Request> {
        self.get(self.slot_of(id)?)
    }

    pub fn values(&self) -> impl Iterator<Item = &Request> {
        self.slots.iter().flatten()
    }
}

impl std::ops::Index<Slot> for RequestTable {
    type Output = Request;

    fn index(&self, slot: Slot) -> &Request {
        self.get(slot).expect("slot is live")
    }
}

impl std::ops::IndexMut<Slot> for RequestTable {
    fn index_mut(&mut self, slot: Slot) -> &mut Request {
        self.get_mut(slot).expect("slot is live")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::NewRequest;

    fn request(id: RequestId) -> Request {
        Request::from_new(NewRequest::new(id, vec![1]), 1, 0)
    }

    #[test]
    fn slots_are_reused_and_ids_follow_them() {
        let mut t = RequestTable::default();
        let (a, b) = (t.insert(request(10)), t.insert(request(11)));
        assert_eq!((a, b, t.len()), (0, 1, 2));
        assert_eq!(t.remove(a).id, 10);
        assert!(!t.contains(10) && t.get(a).is_none());
        let c = t.insert(request(12));
        assert_eq!((c, t.slot_of(12), t.by_id(12).map(|r| r.id)), (a, Some(a), Some(12)));
        assert_eq!(t.values().map(|r| r.id).collect::<Vec<_>>().len(), 2);
    }
}
